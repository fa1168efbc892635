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
# initcheck counts are split into reports on this backend's kernels (must be
# 0) and reports on XLA's own device-to-device copies (host API calls).
# The short summary is printed last; the exit status is 0 only if all passed.
# GPU_CHECK_PARTS=tests or =sanitizers runs only that part (the sanitizers
# have failed to start beside the 8 test processes at times: run them alone).
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
TOOLS="${GPU_CHECK_TOOLS:-memcheck racecheck initcheck}"
MODES="${GPU_CHECK_MODES:-plain graphs}"
san_pids=""
PARTS="${GPU_CHECK_PARTS:-all}"
if [ $build_rc -eq 0 ] && [ -n "$SAN" ] && [ "$PARTS" != tests ]; then
  for tool in $TOOLS; do
    # racecheck looks at this backend's kernels only (name filter). initcheck
    # must instrument every kernel: a write by an uninstrumented kernel (an XLA
    # fusion producing gY, say) is not seen, and the regemm kernel reading it
    # would be reported; its reports are split by kernel below. No backtraces
    # keeps initcheck fast (it also reports XLA's own device-to-device copies).
    opts="--print-limit 20000"
    [ "$tool" = racecheck ] && opts="$opts --kernel-name kns=regemm"
    [ "$tool" = initcheck ] && opts="$opts --show-backtrace no"
    for mode in $MODES; do
      (
        XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $left "$SAN" --tool "$tool" $opts \
          "$PY" tools/sanitize_workload.py "$mode"
        echo "sanitizer exit status: $?"
      ) >"$OUT/.san_${tool}_${mode}.log" 2>&1 &
      san_pids="$san_pids $!"
    done
  done
fi

# --- 2. the test suite -------------------------------------------------------------
# -P: import the installed package, not the source tree in the current directory.
# Everything but the >2^31-element test runs in 8 processes (pytest-xdist, GPU
# memory on demand); that test then runs alone with 60% of the GPU's memory.
test_rc=1
big_rc=1
BIG=test_past_2_31_elements
if [ $build_rc -eq 0 ] && [ "$PARTS" = sanitizers ]; then
  test_rc=0 big_rc=0
elif [ $build_rc -eq 0 ]; then
  par=""
  "$PY" -c "import xdist" 2>/dev/null && par="-n 8"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $left "$PY" -P -m pytest -q -p no:cacheprovider -rfE \
    --durations=15 $par -k "not $BIG" tests >"$OUT/pytest.log" 2>&1
  test_rc=$?
  left2=$((BUDGET - (SECONDS - t0) - 10))
  [ $left2 -lt 30 ] && left2=30
  echo "##### $BIG alone" >>"$OUT/pytest.log"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout $left2 "$PY" -P -m pytest -q -p no:cacheprovider -rfE \
    -k "$BIG" tests >>"$OUT/pytest.log" 2>&1
  big_rc=$?
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
    if [ "$PARTS" = tests ]; then
      line="$line $mode=not-run(tests only)"
      continue
    fi
    if [ ! -f "$f" ]; then
      line="$line $mode=not-run"
      san_bad=1
      continue
    fi
    { echo "##### $tool / $mode"; cat "$f"; } >>"$log"
    ok="$(grep -c "workload ok ($mode)" "$f")"
    if [ "$tool" = racecheck ]; then  # "RACECHECK SUMMARY: n hazards displayed (e errors, w warnings)"
      errs="$(grep -o 'RACECHECK SUMMARY:.*' "$f" | tail -1 | sed -n 's/.*(\([0-9]*\) errors, \([0-9]*\) warnings).*/\1/p')"
      warns="$(grep -o 'RACECHECK SUMMARY:.*' "$f" | tail -1 | sed -n 's/.*(\([0-9]*\) errors, \([0-9]*\) warnings).*/\2/p')"
      [ -z "$errs" ] && errs="$(grep -o 'ERROR SUMMARY: [0-9]* error' "$f" | tail -1 | grep -o '[0-9]*')" && warns=0
    else
      errs="$(grep -o 'ERROR SUMMARY: [0-9]* error' "$f" | tail -1 | grep -o '[0-9]*')"
    fi
    if [ -z "$errs" ] || [ "$ok" -eq 0 ]; then
      line="$line $mode=FAILED-TO-RUN"
      san_bad=1
    elif [ "$tool" = initcheck ]; then
      # Each kernel report is "Uninitialized __global__ memory read ..." then "at <kernel>".
      ours="$(grep -A1 'Uninitialized __global__ memory' "$f" | grep -c 'at .*regemm::')"
      kern="$(grep -c 'Uninitialized __global__ memory' "$f")"
      api="$(grep -c 'Host API memory access error' "$f")"
      line="$line $mode=$errs errors ($ours in regemm kernels, $((kern - ours)) in other kernels, $api in XLA's memcpys)"
      [ "$ours" -ne 0 ] && san_bad=1
      [ "$errs" -gt 20000 ] && san_bad=1  # more than were printed: cannot tell whose
    else
      line="$line $mode=$errs errors${warns:+/$warns warnings}"
      [ "$errs" -ne 0 ] && san_bad=1
    fi
    warns=""
    rm -f "$f"
  done
  san_summary="$san_summary$line"$'\n'
done

tests_line="$(grep -E ' in [0-9.]+s' "$OUT/pytest.log" 2>/dev/null | head -1)"
big_line="$(grep -E ' in [0-9.]+s' "$OUT/pytest.log" 2>/dev/null | sed -n 2p)"
{
  echo "===== gpu_check summary ====="
  echo "device: $(head -2 "$OUT/env.log" | tail -1)"
  echo "build: $([ $build_rc -eq 0 ] && echo ok || echo "FAILED (rc=$build_rc, see build.log)") in ${build_s}s"
  echo "tests: ${tests_line:-no result} (rc=$test_rc)"
  echo "tests, >2^31 elements alone: ${big_line:-no result} (rc=$big_rc); tests took ${test_s}s"
  echo "sanitizer (${SAN:-compute-sanitizer not found}):"
  printf '%s' "$san_summary" | sed 's/^/  /'
  echo "total: $((SECONDS - t0))s"
} | tee "$OUT/summary.txt"

[ $build_rc -eq 0 ] && [ $test_rc -eq 0 ] && [ $big_rc -eq 0 ] && [ $san_bad -eq 0 ]
