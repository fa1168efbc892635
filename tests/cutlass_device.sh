#!/bin/bash
# On the device machine: build the standalone check library of the CUTLASS
# kernels and run tests/cutlass_check.py (correctness + per-config timing).
#
#   tests/cutlass_device.sh [PREBUILT_DIR] [check.py args...]
#
# PREBUILT_DIR (default .cutlass_prebuilt) holds kernel objects compiled
# elsewhere with cutlass.cmake's flags (the kernels take ~1 min each to build;
# the device's time is scarce); without it they are built here from source
# (needs nvidia-cutlass on PYTHONPATH), 16 at a time.
set -o pipefail
OUT=${OUT:-/tmp/cutlass_out}
mkdir -p "$OUT"
PRE=${1:-.cutlass_prebuilt}
shift || true
FLAGS="-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Xcompiler=-fPIC"
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv; nvcc --version | tail -2; } | tee "$OUT/env.txt"

if ! ls "$PRE"/cutlass_*.o >/dev/null 2>&1; then
  echo "no prebuilt kernels in $PRE: building from source"
  ROOT=$(python3 -c "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source'))") || exit 1
  PRE=/tmp/cutlass_objs
  mkdir -p $PRE/src
  for dt in bf16:kBF16 f16:kF16 f32:kF32; do for ta in false true; do for tb in false true; do
    for cfg in coop:kCoop128x256 ping:kPing128x128 streamk:kStreamK128x128; do
      n=cutlass_${dt%%:*}_${ta:0:1}${tb:0:1}_${cfg%%:*}
      sed -e "s/@REGEMM_DT@/${dt##*:}/g; s/@REGEMM_TA@/$ta/g; s/@REGEMM_TB@/$tb/g; s/@REGEMM_CFG@/${cfg##*:}/g" \
        ffi/cuda/cutlass_inst.cu.in > $PRE/src/$n.cu
    done; done; done; done
  ls $PRE/src/*.cu | xargs -P 16 -I{} sh -c 'nvcc '"$FLAGS"' -Xptxas=-Werror -I'"$ROOT"'/include -I'"$ROOT"'/tools/util/include -Iffi/cuda -c {} -o '"$PRE"'/$(basename {} .cu).o' \
    2>&1 | tee "$OUT/build.log" || exit 1
fi

LIB=/tmp/libregemm_cutlass_check.so
nvcc $FLAGS -shared -Iffi/cuda tests/cutlass_capi.cu ffi/cuda/cutlass_dispatch.cu "$PRE"/cutlass_*.o -o $LIB 2>&1 | grep -v "warning #\|^$\|Remark" || true
[ -f $LIB ] || { echo "link failed"; exit 1; }
echo "HGMMA instructions in the bf16 128x256 kernel: $(cuobjdump -sass "$PRE"/cutlass_bf16_ff_coop.o 2>/dev/null | grep -c HGMMA)"
PYTHONUNBUFFERED=1 python3 tests/cutlass_check.py --lib $LIB --out "$OUT" "$@" 2>&1 | tee "$OUT/check.log"

# Optional: the package through JAX (REGEMM_JAX=1): install it (the kernels
# from $PRE when its stamp matches), then regemm vs XLA in one process
# (benchmarks/bench_gpu.py) and the API-level tests, each under a time limit.
if [ "${REGEMM_JAX:-0}" = 1 ]; then
  t0=$SECONDS
  CMAKE_BUILD_PARALLEL_LEVEL=16 REGEMM_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -v \
    -C cmake.define.REGEMM_CUTLASS_PREBUILT="$PWD/$PRE" . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
  grep -i "jax_regemm:" "$OUT/install.log" | head -5
  echo "install: $((SECONDS - t0)) s"
  cd /tmp && python3 -c "import jax_regemm as rg; print(rg.kernels())" && cd - > /dev/null
  timeout "${BENCH_S:-240}" python3 benchmarks/bench_gpu.py --layers "${BENCH_LAYERS:-16384:4096:4096,8192:1024:4096,4096:4096:1024,65536:256:256,2048:1024:1024}" \
    --dtypes "${BENCH_DTYPES:-bf16,f32_default}" --modes fwd --no-mlp --repeats 10 --out "$OUT/bench" 2>&1 | tail -60 | tee "$OUT/bench.log"
  timeout "${PYTEST_S:-120}" python3 -P -m pytest -q -x tests/test_gpu_cutlass.py 2>&1 | tail -15 | tee "$OUT/pytest.log"
fi
