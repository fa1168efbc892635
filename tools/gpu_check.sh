#!/usr/bin/env bash
# Device check of the CUDA backend. Run on the GPU machine from the repository
# root; needs no network. In one go (under 8 minutes on an H100):
#   1. builds and installs the package with the CUDA extension (REGEMM_CUDA=ON),
#   2. runs the whole test suite on the GPU,
#   3. meanwhile runs compute-sanitizer (memcheck, racecheck, initcheck) over
#      tools/sanitize_workload.py, once with XLA command buffers off and once
#      with every regemm call captured into a CUDA graph.
# Full logs go to $OUT (default ./gpu_check_out): env.log, build.log,
# pytest.log, sanitizer_{memcheck,racecheck,initcheck}.log, summary.txt.
# The short summary is printed last; the exit status is 0 only if all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-470}"  # seconds for the whole check; tests and sanitizers get what the build leaves
export PYTHONUNBUFFERED=1 REGEMM_CUDA=ON
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-16}"
t0=$SECONDS

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvcc --version | tail -2
  "$PY" -P -c "import sys, jax; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
} >"$OUT/env.log" 2>&1

# --- 1. build -----------------------------------------------------------------
"$PY" -m pip install --no-build-isolation --no-deps -v . >"$OUT/build.log" 2>&1
build_rc=$?
build_s=$((SECONDS - t0))
left=$((BUDGET - build_s - 15))
[ $left -lt 60 ] && left=60
if [ $build_rc -eq 0 ]; then
  "$PY" -P -c "import jax_regemm as rg; print(rg.kernels())" >>"$OUT/env.log" 2>&1 || build_rc=99
fi

# --- 3. sanitizers, in the background (small GPU footprint each) ---------------
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
  /usr/local/cuda*/compute-sanitizer/compute-sanitizer /opt/nvidia/*/compute-sanitizer/compute-sanitizer \
  2>/dev/null | head -1)"
TOOLS="memcheck racecheck initcheck"
MODES="plain graphs"
san_pids=""
if [ $build_rc -eq 0 ] && [ -n "$SAN" ]; then
  for tool in $TOOLS; do
    # racecheck and initcheck look at this backend's kernels only (name filter):
    # cuBLAS reads its own uninitialised workspace by design. memcheck checks all.
    filter=""
    [ "$tool" != memcheck ] && filter="--kernel-name kns=regemm"
    for mode in $MODES; do
      (
        XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $left "$SAN" --tool "$tool" $filter --print-limit 50 \
          "$PY" tools/sanitize_workload.py "$mode"
        echo "sanitizer exit status: $?"
      ) >"$OUT/.san_${tool}_${mode}.log" 2>&1 &
      san_pids="$san_pids $!"
    done
  done
fi

# --- 2. the test suite -------------------------------------------------------------
test_rc=1
if [ $build_rc -eq 0 ]; then
  # -P: import the installed package, not the source tree in the current directory.
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout $left "$PY" -P -m pytest -q -p no:cacheprovider -rfE --durations=15 tests \
    >"$OUT/pytest.log" 2>&1
  test_rc=$?
fi
test_s=$((SECONDS - t0 - build_s))
[ -n "$san_pids" ] && wait $san_pids

# --- summary -------------------------------------------------------------------------
san_summary=""
san_bad=0
for tool in $TOOLS; do
  log="$OUT/sanitizer_${tool}.log"
  : >"$log"
  line="$tool:"
  for mode in $MODES; do
    f="$OUT/.san_${tool}_${mode}.log"
    if [ -f "$f" ]; then
      { echo "##### $tool / $mode"; cat "$f"; } >>"$log"
      errs="$(grep -o 'ERROR SUMMARY: [0-9]* error' "$f" | tail -1 | grep -o '[0-9]*')"
      ok="$(grep -c "workload ok ($mode)" "$f")"
      if [ -z "$errs" ] || [ "$ok" -eq 0 ]; then
        line="$line $mode=FAILED-TO-RUN"
        san_bad=1
      else
        line="$line $mode=$errs errors"
        [ "$errs" -ne 0 ] && san_bad=1
      fi
      rm -f "$f"
    else
      line="$line $mode=not-run"
      san_bad=1
    fi
  done
  san_summary="$san_summary$line"$'\n'
done

tests_line="$(grep -E ' in [0-9.]+s' "$OUT/pytest.log" 2>/dev/null | tail -1)"
{
  echo "===== gpu_check summary ====="
  echo "device: $(head -2 "$OUT/env.log" | tail -1)"
  echo "build: $([ $build_rc -eq 0 ] && echo ok || echo "FAILED (rc=$build_rc, see build.log)") in ${build_s}s"
  echo "tests: ${tests_line:-no result (rc=$test_rc)} (rc=$test_rc, ${test_s}s)"
  echo "sanitizer (${SAN:-compute-sanitizer not found}):"
  printf '%s' "$san_summary" | sed 's/^/  /'
  echo "total: $((SECONDS - t0))s"
} | tee "$OUT/summary.txt"

[ $build_rc -eq 0 ] && [ $test_rc -eq 0 ] && [ $san_bad -eq 0 ]
