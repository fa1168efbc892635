#!/usr/bin/env bash
# Whether ptxas serializes any wgmma of the narrow MLP's kernels: a compile-time property, so
# this needs nvcc and no GPU. ptxas keeps a kernel's wgmma asynchronous only where it can prove
# the pipeline safe; otherwise it waits after each one and says so in a "Potential Performance
# Loss" note (C75xx: a wgmma under a branch it cannot prove warpgroup-uniform, accumulators
# read by other instructions while a wgmma is in flight, too few registers for the pipeline, ...).
# A serialized kernel still computes the right numbers, so no test sees it; this does.
#
#   tools/wgmma_serialization.sh [translation unit ...]   (default: the narrow kernels' four)
# Prints each note (kernel and reason) and exits 1 if there is one. The units run in parallel:
# 2 minutes for the four on 2 cores. (C7519, a warpgroup.arrive the compiler adds before a
# wgmma, is no such note.)
set -uo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-nvcc}"
PY="${PYTHON:-python3}"
UNITS=("$@")
[ ${#UNITS[@]} -eq 0 ] && UNITS=(ffi/cuda/narrow/narrow_{fwd,bwd}_{bf16,f16}.cu)
INC=(-Iffi -I"$("$PY" -c 'import jax.ffi; print(jax.ffi.include_dir())')" -I"$("$PY" -c 'import nanobind; print(nanobind.include_dir())')")
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
for u in "${UNITS[@]}"; do
  n="$(basename "$u" .cu)"
  # The library's flags for these units (CMakeLists.txt: REGEMM_SM90A where it builds 90a).
  ( "$NVCC" -ptx -O3 -std=c++17 -gencode=arch=compute_90a,code=compute_90a --expt-relaxed-constexpr \
      -DREGEMM_SM90A -DNDEBUG "${INC[@]}" "$u" -o "$TMP/$n.ptx" &&
    ptxas -arch=sm_90a -v "$TMP/$n.ptx" -o "$TMP/$n.cubin" ) >"$TMP/$n.log" 2>&1 || echo "$u: build failed" >>"$TMP/$n.log" &
done
wait
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
