#!/usr/bin/env bash
# Device check of the CUDA backend. Run on the GPU machine from the repository
# root; needs no network. In one go (9-10 minutes on an H100 with the CUTLASS
# kernel objects prebuilt, ffi/cuda/cutlass/prebuild.sh, and build/ left by a
# build just before on the same machine: the package's build directory is
# kept, so the check's own build is incremental, 37 s against 103-122 s), or in
# two calls (GPU_CHECK_PARTS below):
#   1. builds and installs the package with the CUDA extension (REGEMM_CUDA=ON),
#   2. runs the whole test suite on the GPU,
#   3. then, one process at a time, runs compute-sanitizer's memcheck,
#      racecheck and initcheck over tools/sanitize_workload.py, once with XLA
#      command buffers off ("plain") and once with every regemm call captured
#      into a CUDA graph ("graphs"), and over the two harnesses below.
#
# What racecheck and initcheck cannot cover, and how it is covered instead.
# The sm90 GEMMs of CUTLASS and cuBLASLt store their output through Hopper's
# copy engine (TMA), and initcheck does not see such stores: it reports every
# later read. Shown on the mechanism alone by tools/tma_sanitizer_repro.cu,
# run here under each tool (its counts are in the summary). racecheck fails
# with an internal error in any process that runs those kernels, even with
# them left uninstrumented by name (results/h100_gpu_check_summary.txt; the
# repro's single TMA copy does not set it off). So under those two tools the
# workload runs its GEMMs on the SIMT kernel (REGEMM_BACKEND=cuda_simt: the TMA
# GEMMs are the exclusion, named in the summary), and the epilogue pass, which
# reads their output in the product, runs in tools/sanitize_pass.cu over
# inputs copied from the host. memcheck runs the workload with every backend,
# and in plain mode the tuner runs every way it times.
#
# Full logs go to $OUT (default ./gpu_check_out): env.log, build.log,
# pytest.log, wgmma_probe.log, sanitizer_{memcheck,racecheck,initcheck}.log, tma_repro.log,
# summary.txt. initcheck counts are split into reports on this backend's
# kernels and on others' (both must be 0) and on XLA's own device-to-device
# copies (host API calls, not ours).
# The exit status is 0 only if every part ran and passed. GPU_CHECK_PARTS=tests
# or =sanitizers runs one part (the summary says the other did not run, and the
# exit status is 2 even if the part passed). The whole check needs more than one
# 10-minute call (tests about 350 s, sanitizers 140-210 s), so it also runs as two
# calls on one machine: GPU_CHECK_PARTS=tests, then =sanitizers (where a fresh build and the
# suite outrun one call, as on the H200 since 2026-12: build 180-200 s, tests 400 s, the tests
# part in shards: GPU_CHECK_SHARD=1/2, then 2/2, each every other test, REGEMM_TEST_SHARD; the
# last shard runs the >2^31-element test). The tests part
# records its result under build/ (kept between calls) for the tree it ran on
# (a hash of the sources, not the commit: the device's .git may be older than the
# tree); the sanitizers part, on the same tree, reports both and exits 0 only if
# both passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-580}"  # seconds for the whole check
SAN_S="${GPU_CHECK_SANITIZER_S:-150}"  # seconds kept for the sanitizers (they took 103-108 s)
PARTS="${GPU_CHECK_PARTS:-all}"
SHARD="${GPU_CHECK_SHARD:-}"  # i/n: the tests part runs that shard of the suite
[ -n "$SHARD" ] && [ "$PARTS" != tests ] && { echo "gpu_check: GPU_CHECK_SHARD goes with GPU_CHECK_PARTS=tests" >&2; exit 1; }
[ "$PARTS" = tests ] && SAN_S=0  # the tests part keeps nothing back for the sanitizers
PARTS_DIR="${GPU_CHECK_PARTS_DIR:-build/gpu_check_parts}"
TREE="$(find CMakeLists.txt pyproject.toml ffi jax_regemm tests tools examples -type f -not -path '*/__pycache__/*' \
  | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)"
export PYTHONUNBUFFERED=1 REGEMM_CUDA=ON
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-16}"
t0=$SECONDS

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvcc --version | tail -2
  "$PY" -P -c "import sys, jax; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
} >"$OUT/env.log" 2>&1

# --- 1. build -----------------------------------------------------------------
# The CUTLASS headers of a carried wheel on the path, as for any device run (device_install.sh,
# its install left to this check). A build without the CUTLASS sm90 kernels is not the product:
# its dgrad_dact is cuBLAS's GEMM and a pass, which skips or changes what many tests check (a
# check at 86534e7 ran so, unnoticed: 3 in-place tests failed, 204 more tests skipped), so
# it fails here unless GPU_CHECK_NO_CUTLASS=1 says that build is the one meant.
REGEMM_SKIP_INSTALL=1 source tools/device_install.sh
"$PY" -m pip install --no-build-isolation --no-deps -v . >"$OUT/build.log" 2>&1
build_rc=$?
if [ $build_rc -eq 0 ]; then
  "$PY" -P -c "import jax_regemm as rg; print(rg.kernels())" >>"$OUT/env.log" 2>&1 || build_rc=99
fi
if [ $build_rc -eq 0 ] && [ "${GPU_CHECK_NO_CUTLASS:-0}" != 1 ] \
   && ! "$PY" -P -c "import sys; from jax_regemm import _ffi; sys.exit(not _ffi.cutlass_dtypes())"; then
  echo "gpu_check: this build has no CUTLASS kernels (carry .whl/nvidia_cutlass-*.whl, or GPU_CHECK_NO_CUTLASS=1)" \
    | tee -a "$OUT/build.log" >&2
  build_rc=96
fi
NVCC="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a"
# The two harnesses' binaries outside $OUT, which keeps only logs (a device
# tool that brings back a limited number of files then brings the logs).
BIN="$(mktemp -d)"
trap 'rm -rf "$BIN"' EXIT
$NVCC -o "$BIN/tma_repro" tools/tma_sanitizer_repro.cu >>"$OUT/build.log" 2>&1 || build_rc=98
$NVCC -Iffi -o "$BIN/sanitize_pass" tools/sanitize_pass.cu ffi/cuda/epilogue/epilogue_pass.cu >>"$OUT/build.log" 2>&1 \
  || build_rc=97
$NVCC -Iffi -o "$BIN/wgmma_probe" tools/wgmma_probe.cu >>"$OUT/build.log" 2>&1 || build_rc=95
build_s=$((SECONDS - t0))

# --- 2. the test suite -------------------------------------------------------------
# -P: import the installed package, not the source tree in the current directory.
# Everything but the >2^31-element test runs in one process per CPU core, 16 at
# most (pytest-xdist, GPU memory on demand: most tests spend their time
# compiling); that test then runs alone with 60% of the GPU's memory.
test_rc=1 big_rc=1
BIG=test_past_2_31_elements
if [ $build_rc -eq 0 ] && [ "$PARTS" != sanitizers ]; then
  left=$((BUDGET - build_s - SAN_S - 40))
  [ $left -lt 60 ] && left=60
  par=""
  procs=$(nproc); [ "$procs" -gt 16 ] && procs=16
  "$PY" -c "import xdist" 2>/dev/null && par="-n $procs"
  # The wgmma forms of the narrow MLP's kernels, each against the host (a failure is a test's).
  "$BIN/wgmma_probe" >"$OUT/wgmma_probe.log" 2>&1
  probe_rc=$?
  # -v: each outcome is printed as it happens, so a run cut by its timeout still names its failures.
  REGEMM_TEST_SHARD="$SHARD" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $left "$PY" -P -m pytest -v \
    -p no:cacheprovider -rfE --durations=15 $par -k "not $BIG" tests >"$OUT/pytest.log" 2>&1
  test_rc=$?
  [ $probe_rc -eq 0 ] || test_rc=1
  echo "##### $BIG alone" >>"$OUT/pytest.log"
  if [ -z "$SHARD" ] || [ "${SHARD%/*}" = "${SHARD#*/}" ]; then
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout 40 "$PY" -P -m pytest -q -p no:cacheprovider -rfE \
      -k "$BIG" tests >>"$OUT/pytest.log" 2>&1
    big_rc=$?
  else
    big_rc=0 big_elsewhere=1
  fi
fi
test_s=$((SECONDS - t0 - build_s))

# --- 3. sanitizers -----------------------------------------------------------------
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
  /usr/local/cuda*/compute-sanitizer/compute-sanitizer /opt/nvidia/*/compute-sanitizer/compute-sanitizer \
  2>/dev/null | head -1)"
TOOLS="memcheck racecheck initcheck"
MODES="plain graphs"
REPRO_WRITERS="plain bulk tensor tensor-uninstrumented tensor-load"
san_on=0
[ $build_rc -eq 0 ] && [ -n "$SAN" ] && [ "$PARTS" != tests ] && san_on=1
# Options per tool. racecheck looks at this backend's kernels only (name
# filter). initcheck must instrument every kernel: a write by an
# uninstrumented kernel (an XLA fusion producing gY, say) is not seen, and the
# regemm kernel reading it would be reported. No backtraces keeps it fast.
san_opts() {
  case "$1" in
    racecheck) echo "--print-limit 20000 --kernel-name kns=regemm" ;;
    initcheck) echo "--print-limit 20000 --show-backtrace no" ;;
    *) echo "--print-limit 20000" ;;
  esac
}
# One sanitizer process at a time (started beside the test processes, they
# failed to start). compute-sanitizer over the Python workload also segfaults
# now and then before the program prints anything (exit 139 right after its
# banner; 4 of 18 starts on the H100, in either mode, under either tool): such
# a run is started again, twice at most, and the summary says so. A crash
# after the program started is a failure like any other.
san_run() {  # LOG TIMEOUT ARGS...: one run, its exit status appended to LOG
  local log=$1 limit=$2 try
  shift 2
  for try in 1 2 3; do
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$limit" "$SAN" "$@" >"$log" 2>&1
    local rc=$?
    echo "sanitizer exit status: $rc" >>"$log"
    # A start that hangs before the program prints anything (racecheck, plain, on the H200 at
    # 093da1a: over 6 minutes at its banner) is cut at the run's limit and started again too.
    { [ $rc -eq 139 ] || [ $rc -eq 124 ]; } && [ "$(grep -vc '^========= COMPUTE-SANITIZER$' "$log")" -le 1 ] || break
    echo "sanitizer start $try crashed or hung before the program printed anything" >>"$OUT/.restarts"
  done
  [ "$try" -gt 1 ] && echo "(started on attempt $try)" >>"$log"
  return 0
}
if [ $san_on -eq 1 ]; then
  : >"$OUT/tma_repro.log"
  for tool in $TOOLS; do
    for writer in $REPRO_WRITERS; do
      # tensor-uninstrumented: the TMA writer left out by name, only the reader instrumented.
      filter=""
      [ "$writer" = tensor-uninstrumented ] && filter="--kernel-name kns=read_tile"
      san_run "$OUT/.repro" 60 --tool "$tool" $filter "$BIN/tma_repro" "${writer%-uninstrumented}"
      { echo "##### $tool / $writer"; cat "$OUT/.repro"; } >>"$OUT/tma_repro.log"
    done
    san_run "$OUT/.pass_${tool}.log" 120 --tool "$tool" $(san_opts "$tool") "$BIN/sanitize_pass"
    for mode in $MODES; do
      left=$((BUDGET - (SECONDS - t0) - 10))
      [ $left -gt "${GPU_CHECK_RUN_S:-120}" ] && left=${GPU_CHECK_RUN_S:-120}  # one run took 15-40 s
      [ $left -lt 30 ] && left=30
      san_run "$OUT/.san_${tool}_${mode}.log" $left --tool "$tool" $(san_opts "$tool") \
        "$PY" tools/sanitize_workload.py "$mode" "$tool"
    done
  done
  rm -f "$OUT/.repro"
fi
san_s=$((SECONDS - t0 - build_s - test_s))

# --- summary -------------------------------------------------------------------------
# errors TOOL LOG: the tool's error count in LOG (racecheck: errors, then
# warnings), empty when the tool did not finish.
errors() {
  if [ "$1" = racecheck ]; then  # "RACECHECK SUMMARY: n hazards displayed (e errors, w warnings)"
    local s
    s="$(grep -o 'RACECHECK SUMMARY:.*' "$2" | tail -1 | sed -n 's/.*(\([0-9]*\) errors, \([0-9]*\) warnings).*/\1 \2/p')"
    [ -z "$s" ] && s="$(grep -o 'ERROR SUMMARY: [0-9]* error' "$2" | tail -1 | grep -o '[0-9]*')" && [ -n "$s" ] && s="$s 0"
    echo "$s"
  else
    local e skipped
    e="$(grep -o 'ERROR SUMMARY: [0-9]* error' "$2" | tail -1 | grep -o '[0-9]*')"
    # Past its error buffer the tool drops reports and counts them apart.
    skipped="$(grep -o '[0-9]* errors were skipped' "$2" | grep -o '^[0-9]*' | awk '{s += $1} END {print s + 0}')"
    [ -n "$e" ] && echo $((e + skipped))
  fi
}
san_bad=0
san_summary=""
for tool in $TOOLS; do
  log="$OUT/sanitizer_${tool}.log"
  : >"$log"
  line="$tool:"
  for mode in $MODES pass; do
    if [ $mode = pass ]; then f="$OUT/.pass_${tool}.log" ok_text="epilogue pass ok"; else
      f="$OUT/.san_${tool}_${mode}.log" ok_text="workload ok ($mode)"; fi
    if [ ! -f "$f" ]; then
      line="$line $mode=not-run"
      san_bad=1
      continue
    fi
    { echo "##### $tool / $mode"; cat "$f"; } >>"$log"
    read -r errs warns <<<"$(errors "$tool" "$f")"
    attempt="$(sed -n 's/^(started on attempt \([0-9]\))$/ (started on attempt \1)/p' "$f")"
    if [ -z "${errs:-}" ] || ! grep -q "$ok_text" "$f"; then
      # How it ended, in the summary itself: the exit status and the program's last line.
      last="$(grep -v '^$' "$f" | grep -v '^sanitizer exit status\|^(started on' | tail -1 | cut -c1-160)"
      line="$line $mode=FAILED-TO-RUN ($(grep -o 'sanitizer exit status: [0-9]*' "$f" | tail -1)$attempt; last line: $last)"
      san_bad=1
    elif [ "$tool" = initcheck ]; then
      # Each kernel report is "Uninitialized __global__ memory read ..." then "at <kernel>".
      ours="$(grep -A1 'Uninitialized __global__ memory' "$f" | grep -c 'at .*regemm::')"
      kern="$(grep -c 'Uninitialized __global__ memory' "$f")"
      api="$(grep -c 'Host API memory access error' "$f")"
      line="$line $mode=$errs errors ($ours in regemm kernels, $((kern - ours)) in other kernels, $api in XLA's memcpys)$attempt"
      [ "$kern" -ne 0 ] && san_bad=1
      [ "$errs" -gt 20000 ] && san_bad=1  # more than were printed: cannot tell whose
    else
      line="$line $mode=$errs errors${warns:+/$warns warnings}$attempt"
      [ "$errs" -ne 0 ] && san_bad=1
      [ -n "${warns:-}" ] && [ "$warns" -ne 0 ] && san_bad=1
    fi
    rm -f "$f"
  done
  san_summary="$san_summary$line"$'\n'
done
# The repro: one line per tool, each writer's error count (or how it ended).
repro_summary=""
if [ $san_on -eq 1 ]; then
  for tool in $TOOLS; do
    line="$tool:"
    for writer in $REPRO_WRITERS; do
      sect="$(awk -v h="##### $tool / $writer" '$0 == h {on = 1; next} /^##### / {on = 0} on' "$OUT/tma_repro.log")"
      tmp="$OUT/.repro_section"
      printf '%s\n' "$sect" >"$tmp"
      read -r errs warns <<<"$(errors "$tool" "$tmp")"
      rc="$(printf '%s\n' "$sect" | sed -n 's/^sanitizer exit status: //p')"
      if grep -q "Internal Sanitizer Error" "$tmp"; then res="internal sanitizer error (exit $rc)"
      elif ! grep -q "writer: 0 of" "$tmp"; then res="did not finish (exit $rc)"
      else res="${errs:-?} errors${warns:+/$warns warnings}"; fi
      line="$line $writer=$res;"
      rm -f "$tmp"
    done
    repro_summary="$repro_summary$line"$'\n'
  done
fi

tests_line="$(grep -E ' in [0-9.]+s' "$OUT/pytest.log" 2>/dev/null | head -1)"
big_line="$(grep -E ' in [0-9.]+s' "$OUT/pytest.log" 2>/dev/null | sed -n 2p)"
[ "${big_elsewhere:-0}" = 1 ] && big_line="in the last shard"
# Two calls: the tests part leaves its result for the sanitizers part on the same tree (one
# file, or one a shard: the sanitizers part takes the unsharded run, else every shard of one n).
prior="$PARTS_DIR/tests_$TREE${SHARD:+_${SHARD%/*}of${SHARD#*/}}.txt"
if [ "$PARTS" = tests ] && [ $build_rc -eq 0 ]; then
  mkdir -p "$PARTS_DIR"
  printf '%s\n' "$test_rc" "$big_rc" "$tests_line" "$big_line" "$test_s" >"$prior"
fi
prior_ok=0 priors=""
if [ "$PARTS" = sanitizers ]; then
  if [ -f "$prior" ]; then
    priors="$prior"
  else
    n="$(ls "$PARTS_DIR"/tests_"$TREE"_*of*.txt 2>/dev/null | head -1 | sed -E 's/.*of([0-9]+)\.txt$/\1/')"
    for i in $(seq 1 "${n:-0}"); do
      f="$PARTS_DIR/tests_${TREE}_${i}of$n.txt"
      [ -f "$f" ] || { priors=""; break; }
      priors="$priors $f"
    done
  fi
  if [ -n "$priors" ]; then
    prior_ok=1 all_tests="" all_big="" all_s=0
    for f in $priors; do
      { read -r test_rc; read -r big_rc; read -r tests_line; read -r big_line; read -r test_s; } <"$f"
      { [ "$test_rc" = 0 ] && [ "$big_rc" = 0 ]; } || prior_ok=0
      all_tests="${all_tests:+$all_tests; }$tests_line (rc=$test_rc)"
      all_big="${all_big:+$all_big; }$big_line (rc=$big_rc)"
      all_s=$((all_s + test_s))
    done
    tests_line="$all_tests" big_line="$all_big" test_s=$all_s
    test_rc=$((1 - prior_ok)) big_rc=0
  fi
fi
{
  echo "===== gpu_check summary ====="
  # GPU_CHECK_COMMIT: the commit the tree was sent from, where .git did not travel with it.
  echo "commit: ${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- ffi tools tests jax_regemm 2>/dev/null || echo ' (with uncommitted changes)')} (tree $TREE)"
  echo "device: $(head -2 "$OUT/env.log" | tail -1)"
  echo "build: $([ $build_rc -eq 0 ] && echo ok || echo "FAILED (rc=$build_rc, see build.log)") in ${build_s}s"
  echo "kernels: $(tail -1 "$OUT/env.log" | grep -o "'cuda': .*" | head -c 400)"
  if [ "$PARTS" = sanitizers ] && [ -n "$priors" ]; then
    echo "tests (GPU_CHECK_PARTS=tests, the calls before on this machine, the same tree; $(echo $priors | wc -w) part(s)): ${tests_line:-no result}"
    echo "tests, >2^31 elements alone: ${big_line:-no result}; tests took ${test_s}s"
  elif [ "$PARTS" = sanitizers ]; then
    echo "tests: not run (GPU_CHECK_PARTS=sanitizers, and no tests part of this tree before it)"
  else
    echo "tests${SHARD:+ (shard $SHARD)}: ${tests_line:-no result} (rc=$test_rc)"
    echo "wgmma forms (tools/wgmma_probe.cu): $(tail -1 "$OUT/wgmma_probe.log" 2>/dev/null || echo 'not run')"
    echo "tests, >2^31 elements alone: ${big_line:-no result} (rc=$big_rc); tests took ${test_s}s"
  fi
  if [ $san_on -eq 1 ]; then
    echo "sanitizers ($SAN), ${san_s}s; workload in plain and graphs modes, and the epilogue pass alone (pass):"
    printf '%s' "$san_summary" | sed 's/^/  /'
    echo "  excluded under racecheck and initcheck: the GEMM kernels that store through TMA (CUTLASS sm90"
    echo "  cutlass::device_kernel<...>, cuBLASLt's sm90 kernels): the workload runs REGEMM_BACKEND=cuda_simt there."
    echo "  Why: initcheck does not see TMA stores (below); racecheck fails in a process running those kernels"
    echo "  (results/h100_gpu_check_summary.txt). tools/tma_sanitizer_repro.cu, one tile per writer, read by a plain kernel:"
    printf '%s' "$repro_summary" | sed 's/^/    /'
  else
    echo "sanitizers: not run ($([ "$PARTS" = tests ] && echo GPU_CHECK_PARTS=tests || echo "${SAN:-compute-sanitizer not found}; build rc=$build_rc"))"
  fi
  echo "total: $((SECONDS - t0))s"
} | tee "$OUT/summary.txt"

[ $build_rc -eq 0 ] || exit 1
if [ "$PARTS" = all ]; then
  [ $test_rc -eq 0 ] && [ $big_rc -eq 0 ] && [ $san_on -eq 1 ] && [ $san_bad -eq 0 ] && exit 0
  exit 1
fi
[ "$PARTS" = tests ] && [ $test_rc -eq 0 ] && [ $big_rc -eq 0 ] && exit 2
if [ "$PARTS" = sanitizers ] && [ $san_on -eq 1 ] && [ $san_bad -eq 0 ]; then
  [ $prior_ok -eq 1 ] && exit 0  # the tests part of this tree passed too: the whole check
  exit 2
fi
exit 1
