#!/bin/bash
# Builds tools/tile_bench/tile_bench: one object per variant (about a minute
# each), in parallel. Needs the nvidia-cutlass and nvidia-cublas wheels.
#   tools/tile_bench/build.sh JOBS SCHED:M:N:CM:CN[:TA:TB] ...
# e.g. 2 coop:128:256:2:1 ping:128:128:1:1 ping:128:128:1:1:1:0 (SCHED: coop,
# ping or streamk; CMxCN the cluster; TA/TB 0 or 1, default 0). Objects go to
# $TILE_OBJ (default /tmp/tile_bench_obj), the binary next to this script.
# A/B of a header change: TILE_FFI=<a copy of ffi/ with the change> and
# TILE_TAG=<suffix> build the named variants from that copy, under names with
# the suffix (TILE_DEFS: extra -D flags), into the same $TILE_OBJ; TILE_KEEP=1
# keeps the objects already there (build the base variants first). A change
# inside a kernel must also rename the kernel's type in the copy (e.g. an
# inline namespace around cuda/cutlass/cutlass_epilogue.cuh's): kernels of one type from two
# objects share one host stub, and both names would run the same kernel.
# On the GPU machine: LD_LIBRARY_PATH=<site-packages>/nvidia/cu13/lib
#   tools/tile_bench/tile_bench M:K:N:ACT:Z ...   (ACT: regemm::Act value; Z: 1 stores Z)
set -eo pipefail
cd "$(dirname "$0")"
JOBS=${1:?usage: build.sh JOBS V[:TA:TB] ...}
shift
OBJ=${TILE_OBJ:-/tmp/tile_bench_obj}
CL=$(python3 -c "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source'))")
CB=$(python3 -c "import site; print(site.getsitepackages()[0])")/nvidia/cu13
FFI=${TILE_FFI:-../../ffi}
TAG=${TILE_TAG:-}
FLAGS="-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Xptxas=-Werror"
mkdir -p "$OBJ"
[ -n "${TILE_KEEP:-}" ] || rm -f "$OBJ"/*.o
for spec in "$@"; do
  IFS=: read -r sched m n cm cn ta tb <<< "$spec"
  d="-DTILE_SCHED=$sched -DTILE_M=$m -DTILE_N=$n -DTILE_CM=$cm -DTILE_CN=$cn -DTILE_TA=${ta:-0} -DTILE_TB=${tb:-0}"
  echo "nvcc $FLAGS -I$FFI/cuda/cutlass -I$FFI -I$CL/include -I$CL/tools/util/include $d -DTILE_TAG=$TAG ${TILE_DEFS:-} -c variant.cu -o $OBJ/${spec//:/_}$TAG.o"
done | xargs -P "$JOBS" -I{} bash -c "{}"
nvcc $FLAGS -I../../ffi/cuda/cutlass -I../../ffi -I$CL/include -I$CB/include -c main.cu -o "$OBJ/main.o"
nvcc -gencode=arch=compute_90a,code=sm_90a "$OBJ"/*.o -L"$CB/lib" -Xlinker -l:libcublas.so.13 -o tile_bench
ls -la tile_bench
