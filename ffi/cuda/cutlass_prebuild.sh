#!/bin/bash
# Builds the CUTLASS kernel objects outside CMake, for REGEMM_CUTLASS_PREBUILT
# (a developer speed-up: compile once where time is free, link on the device
# machine). Same template, names and flags as cutlass.cmake; writes a stamp of
# the sources so that cutlass.cmake ignores objects built from other sources.
#
#   ffi/cuda/cutlass_prebuild.sh OUTDIR [JOBS] [DTYPES] [KERNELS]     (run from the repo root)
#
# KERNELS: "all" (default), or "dgrad" for the dgrad kernels alone (their
# stamp is their own: cutlass_stamp.sh), into an OUTDIR that holds the rest.
#
# CUTLASS headers: REGEMM_CUTLASS_DIR, or the nvidia-cutlass wheel on the Python path.
set -eo pipefail
OUTDIR=${1:?usage: cutlass_prebuild.sh OUTDIR [JOBS] [DTYPES] [KERNELS]}
JOBS=${2:-$(nproc)}
DTYPES=${3:-"bf16 f16 f32"}
KERNELS=${4:-all}
ROOT=${REGEMM_CUTLASS_DIR:-$(python3 -c "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source'))")}
[ -f "$ROOT/include/cutlass/cutlass.h" ] || { echo "no CUTLASS headers at $ROOT" >&2; exit 1; }
mkdir -p "$OUTDIR/src"
FLAGS="-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Xptxas=-Werror -Xcompiler=-fPIC"

declare -A ENUM=([bf16]=kBF16 [f16]=kF16 [f32]=kF32)
declare -A CFG=([coop]=kCoop128x256 [ping]=kPing128x128 [streamk]=kStreamK128x128 [ping1]=kPing128x128c1)
# Kernels of one activation (cutlass_kernels.h, kOneActs): ping1, every dtype.
declare -A ACT=([gelu]=kGelu [gelu_erf]=kGeluErf [sigmoid]=kSigmoid [silu]=kSilu)
rm -f "$OUTDIR"/src/*.cu
[ "$KERNELS" = all ] && for dt in $DTYPES; do for ta in false true; do for tb in false true; do for c in coop ping streamk ping1; do
  acts=any
  [ "$c" = ping1 ] && acts="any gelu gelu_erf sigmoid silu"
  for act in $acts; do
    n=cutlass_${dt}_${ta:0:1}${tb:0:1}_$c
    a=kAnyAct
    [ "$act" = any ] || { n=${n}_$act; a="int(Act::${ACT[$act]})"; }
    sed -e "s/@REGEMM_DT@/${ENUM[$dt]}/g; s/@REGEMM_TA@/$ta/g; s/@REGEMM_TB@/$tb/g; s/@REGEMM_CFG@/${CFG[$c]}/g" \
        -e "s/@REGEMM_ACT@/$a/g" ffi/cuda/cutlass_inst.cu.in > "$OUTDIR/src/$n.cu"
  done
done; done; done; done
# regemm_dgrad_dact's kernels (cutlass.cmake has the same list).
for k in bf16:false bf16:true f16:true f32:true; do
  dt=${k%%:*} tb=${k##*:}
  case " $DTYPES " in *" $dt "*) ;; *) continue ;; esac
  for slot in 0 1 2 3 4 5; do
    sed -e "s/@REGEMM_DT@/${ENUM[$dt]}/g; s/@REGEMM_TB@/$tb/g; s/@REGEMM_SLOT@/$slot/g" \
        ffi/cuda/cutlass_dgrad_inst.cu.in > "$OUTDIR/src/cutlass_dgrad_${dt}_f${tb:0:1}_a$slot.cu"
  done
done

export FLAGS ROOT OUTDIR
ls "$OUTDIR"/src/*.cu | xargs -P "$JOBS" -I{} bash -c \
  'n=$(basename {} .cu); nvcc $FLAGS -I"$ROOT/include" -I"$ROOT/tools/util/include" -Iffi/cuda -c {} -o "$OUTDIR/$n.o" 2> "$OUTDIR/src/$n.log" || { cat "$OUTDIR/src/$n.log"; exit 255; }'
[ "$KERNELS" = all ] && ffi/cuda/cutlass_stamp.sh "$ROOT" fwd > "$OUTDIR/sources.sha256"
ffi/cuda/cutlass_stamp.sh "$ROOT" dgrad > "$OUTDIR/dgrad_sources.sha256"
echo "built $(ls "$OUTDIR"/cutlass_*.o | wc -l) kernel objects in $OUTDIR (stamp $(cat "$OUTDIR/sources.sha256"))"
