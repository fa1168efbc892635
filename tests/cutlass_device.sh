#!/bin/bash
# On the device machine: the CUTLASS kernels' correctness and per-config timing
# (tests/cutlass_check.py, no XLA), then optionally the package through JAX.
#
#   tests/cutlass_device.sh [PREBUILT_DIR] [check.py args...]
#
# Kernel objects: PREBUILT_DIR (default .cutlass_prebuilt) if its stamp matches
# the sources, else built here (ffi/cuda/cutlass/prebuild.sh, 16 at a time,
# ~3 min) and sent back as $OUT/cutlass_prebuilt.tgz for the next run. CUTLASS
# headers: the nvidia-cutlass wheel from .whl/ (carried: no network there).
#
# REGEMM_JAX=1 also installs the package (linking those objects) and runs
# benchmarks/bench_gpu.py (regemm vs XLA, forward) and tests/test_gpu_cutlass.py.
set -o pipefail
OUT=${OUT:-/tmp/cutlass_out}
mkdir -p "$OUT"
PRE=${1:-.cutlass_prebuilt}
shift || true
t0=$SECONDS
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv; nvcc --version | tail -2; } | tee "$OUT/env.txt"

if ls .whl/nvidia_cutlass*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/nvidia_cutlass*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
ROOT=$(python3 -c "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source') if s else '')")
STAMP=$([ -n "$ROOT" ] && cmake -DSTAMP=fwd -DCUTLASS_ROOT="$ROOT" -P ffi/cuda/cutlass/kernels.cmake 2>&1)
if [ -z "$STAMP" ] || [ "$(cat "$PRE/fwd.sha256" 2>/dev/null)" != "$STAMP" ]; then
  [ -n "$ROOT" ] || { echo "no prebuilt kernels for these sources and no CUTLASS headers"; exit 1; }
  echo "building the kernels here"
  PRE=/tmp/cutlass_objs
  ffi/cuda/cutlass/prebuild.sh $PRE 16 2>&1 | tail -3 | tee "$OUT/build.log" || exit 1
  tar czf "$OUT/cutlass_prebuilt.tgz" -C $PRE $(cd $PRE && ls cutlass_*.o *.sha256)
  echo "kernels built in $((SECONDS - t0)) s"
fi

FLAGS="$(cmake -DFLAGS=1 -P ffi/cuda/cutlass/kernels.cmake 2>&1) -Xcompiler=-fPIC"
LIB=/tmp/libregemm_cutlass_check.so
nvcc $FLAGS -shared -Iffi -Iffi/cuda/cutlass tests/cutlass_capi.cu ffi/cuda/cutlass/cutlass_dispatch.cu ffi/cuda/epilogue/epilogue_pass.cu "$PRE"/cutlass_*.o -o $LIB 2>&1 | grep -v "warning #\|^$\|Remark" || true
[ -f $LIB ] || { echo "link failed"; exit 1; }
echo "HGMMA instructions in the bf16 128x256 kernel: $(cuobjdump -sass "$PRE"/cutlass_bf16_ff_coop.o 2>/dev/null | grep -c HGMMA)"
PYTHONUNBUFFERED=1 timeout "${CHECK_S:-200}" python3 tests/cutlass_check.py --lib $LIB --out "$OUT" "$@" 2>&1 | tee "$OUT/check.log"
echo "check done at $((SECONDS - t0)) s"

if [ "${REGEMM_JAX:-0}" = 1 ]; then
  t1=$SECONDS
  CMAKE_BUILD_PARALLEL_LEVEL=16 REGEMM_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -v \
    -C cmake.define.REGEMM_CUTLASS_PREBUILT="$(realpath $PRE)" . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
  grep -i "jax_regemm:" "$OUT/install.log" | head -5
  echo "install: $((SECONDS - t1)) s"
  (cd /tmp && python3 -c "import jax_regemm as rg; print(rg.kernels())")
  timeout "${PYTEST_S:-120}" python3 -P -m pytest -q -x tests/test_gpu_cutlass.py 2>&1 | tail -15 | tee "$OUT/pytest.log"
  # The script's own directory (benchmarks/) goes on sys.path, not the source tree: the installed package is used.
  [ "${BENCH_S:-240}" != 0 ] && timeout "${BENCH_S:-240}" python3 benchmarks/bench_gpu.py --layers "${BENCH_LAYERS:-16384:4096:4096,8192:1024:4096,4096:4096:1024,65536:256:256,2048:1024:1024}" \
    --dtypes "${BENCH_DTYPES:-bf16,f32_default}" --modes fwd --no-mlp --repeats 10 --out "$OUT/bench" 2>&1 | tail -60 | tee "$OUT/bench.log"
fi
echo "all done at $((SECONDS - t0)) s"
