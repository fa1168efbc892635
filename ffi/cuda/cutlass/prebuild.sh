#!/bin/bash
# Builds the CUTLASS kernel objects outside CMake, for REGEMM_CUTLASS_PREBUILT
# (a developer speed-up: compile once where time is free, link on the device
# machine). The kernels, their flags and the stamps are kernels.cmake's, the
# manifest build.cmake reads too; the stamps make build.cmake ignore objects
# built from other sources.
#
#   ffi/cuda/cutlass/prebuild.sh OUTDIR [JOBS] [DTYPES] [FAMILIES]     (run from the repo root)
#
# DTYPES: "bf16 f16 f32" (default). FAMILIES: "fwd dgrad" (default), or one of
# them, into an OUTDIR that holds the other (each family has its own stamp).
# KEEP=1 keeps the objects already in OUTDIR (built from these sources: the
# caller says so) and builds the rest, e.g. to finish elsewhere a build begun here.
# CUTLASS headers: REGEMM_CUTLASS_DIR, or the nvidia-cutlass wheel on the Python path.
set -eo pipefail
OUTDIR=${1:?usage: prebuild.sh OUTDIR [JOBS] [DTYPES] [FAMILIES]}
JOBS=${2:-$(nproc)}
DTYPES=${3:-"bf16 f16 f32"}
FAMILIES=${4:-"fwd dgrad"}
HERE=ffi/cuda/cutlass
ROOT=${REGEMM_CUTLASS_DIR:-$(python3 -c "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source'))")}
[ -f "$ROOT/include/cutlass/cutlass.h" ] || { echo "no CUTLASS headers at $ROOT" >&2; exit 1; }
mkdir -p "$OUTDIR/src"
rm -f "$OUTDIR"/src/*.cu
[ "${KEEP:-0}" = 1 ] || rm -f "$OUTDIR"/cutlass_*.o
declare -A TEMPLATE=([fwd]=cutlass_inst.cu.in [dgrad]=cutlass_dgrad_inst.cu.in)
cmake -DDTYPES="${DTYPES// /;}" -P $HERE/kernels.cmake 2>&1 | while read -r family name dt ta tb cfg act slot; do
  case " $FAMILIES " in *" $family "*) ;; *) continue ;; esac
  [ -f "$OUTDIR/$name.o" ] && continue  # (KEEP=1)
  sed -e "s/@REGEMM_DT@/$dt/g; s/@REGEMM_TA@/$ta/g; s/@REGEMM_TB@/$tb/g; s/@REGEMM_CFG@/$cfg/g" \
      -e "s/@REGEMM_ACT@/$act/g; s/@REGEMM_SLOT@/$slot/g" "$HERE/${TEMPLATE[$family]}" > "$OUTDIR/src/$name.cu"
done
FLAGS="$(cmake -DFLAGS=1 -P $HERE/kernels.cmake 2>&1) -Xcompiler=-fPIC"
export FLAGS ROOT OUTDIR HERE
# The stamps first (they hash the sources, not the objects), and each object under its name
# only once whole: a build still under way can be carried to the device, whose build links
# the objects there and compiles the rest (a 2-core machine takes 1-2 hours for all 120).
for family in $FAMILIES; do
  cmake -DSTAMP=$family -DCUTLASS_ROOT="$ROOT" -P $HERE/kernels.cmake 2>&1 > /dev/null | head -1 > "$OUTDIR/$family.sha256"
done
find "$OUTDIR/src" -name "*.cu" | xargs -r -P "$JOBS" -I{} bash -c \
  'n=$(basename {} .cu); nvcc $FLAGS -I"$ROOT/include" -I"$ROOT/tools/util/include" -I$HERE -Iffi -c {} -o "$OUTDIR/src/$n.o.part" 2> "$OUTDIR/src/$n.log" && mv "$OUTDIR/src/$n.o.part" "$OUTDIR/$n.o" || { cat "$OUTDIR/src/$n.log"; exit 255; }'

echo "built $(ls "$OUTDIR"/cutlass_*.o | wc -l) kernel objects in $OUTDIR (stamps: $(cat "$OUTDIR"/*.sha256 | tr '\n' ' '))"
