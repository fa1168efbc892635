#!/usr/bin/env bash
# Whether ptxas serializes any wgmma of the narrow MLP's kernels: a compile-time property, so
# this needs nvcc and no GPU. ptxas keeps a kernel's wgmma asynchronous only where it can prove
# the pipeline safe; otherwise it waits after each one and says so in a "Potential Performance
# Loss" note (C75xx: a wgmma under a branch it cannot prove warpgroup-uniform, accumulators
# read by other instructions while a wgmma is in flight, too few registers for the pipeline, ...).
# A serialized kernel still computes the right numbers, so no test sees it; this does.
#
#   tools/wgmma_serialization.sh [translation unit ...]
# (default: the narrow kernels' 16 units, written here from ffi/cuda/narrow/narrow_inst.cu.in
# as CMake writes them). Prints each note (kernel and reason) and exits 1 if there is one. The
# units run $(nproc) at a time. (C7519, a warpgroup.arrive the compiler adds before a wgmma, is
# no such note.)
set -uo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-nvcc}"
PY="${PYTHON:-python3}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
UNITS=("$@")
if [ ${#UNITS[@]} -eq 0 ]; then
  for t in bf16:__nv_bfloat16 f16:__half; do
    for a in kNone kRelu kLeakyRelu kGelu kGeluErf kSigmoid kTanh kSilu; do
      u="$TMP/narrow_${t%%:*}_$a.cu"
      sed -e "s/@REGEMM_NARROW_T@/${t#*:}/" -e "s/@REGEMM_NARROW_ACT@/$a/" ffi/cuda/narrow/narrow_inst.cu.in >"$u"
      UNITS+=("$u")
    done
  done
fi
INC=(-Iffi -I"$("$PY" -c 'import jax.ffi; print(jax.ffi.include_dir())')" -I"$("$PY" -c 'import nanobind; print(nanobind.include_dir())')")
# The library's flags for these units (CMakeLists.txt: REGEMM_SM90A where it builds 90a).
compile() {
  local u="$1" n
  n="$(basename "$u" .cu)"
  ( "$NVCC" -ptx -O3 -std=c++17 -gencode=arch=compute_90a,code=compute_90a --expt-relaxed-constexpr \
      -DREGEMM_SM90A -DNDEBUG "${INC[@]}" "$u" -o "$TMP/$n.ptx" &&
    ptxas -arch=sm_90a -v "$TMP/$n.ptx" -o "$TMP/$n.cubin" ) >"$TMP/$n.log" 2>&1 || echo "$u: build failed" >>"$TMP/$n.log"
}
export -f compile
export NVCC TMP
export INC_FLAGS="${INC[*]}"
printf '%s\n' "${UNITS[@]}" | xargs -P "$(nproc)" -I{} bash -c 'INC=($INC_FLAGS); compile "$1"' _ {}
rc=0
for u in "${UNITS[@]}"; do
  n="$(basename "$u" .cu)"
  if grep -q "build failed" "$TMP/$n.log"; then
    echo "$u: did not compile"; tail -5 "$TMP/$n.log"; rc=1; continue
  fi
  notes="$(grep -E '\(C75[0-9]+\) Potential Performance Loss' "$TMP/$n.log" |
    sed -E "s/.*\((C75[0-9]+)\) Potential Performance Loss: (.*) in the function '([^']+)'.*/\1 \3: \2/" | sort -u)"
  if [ -n "$notes" ]; then
    echo "$u: wgmma serialized"; echo "$notes" | sed 's/^/  /'; rc=1
  else
    echo "$u: no wgmma serialized"
  fi
done
exit $rc
