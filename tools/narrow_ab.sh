#!/usr/bin/env bash
# Two builds of tools/narrow_bench.cu against each other on the GPU, in one call: each binary's
# backward and forward on the reference cells, in turns (A, B, A, B), then B alone on the odd
# cells (the host check: forward, gx, every gW and gb), under compute-sanitizer's four tools on
# small cells, and B's wgmma backward under ncu (where its time goes). Build the two here, where
# time is free (narrow_bench.cu's header gives the line), into a carried folder:
#   tools/narrow_ab.sh A_BINARY B_BINARY     (B_FLAGS: extra variables for B, e.g. NARROW_PAIR=1)
set -uo pipefail
A="$1" B="$2"
chmod +x "$A" "$B"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
BWD="1048576x32x64x4x16 262144x32x64x4x16 1048576x32x32x3x16 1048576x32x16x4x16 65536x32x64x4x16 1048576x32x64x4x16 gelu"
FWD="1048576x32x64x4x16 1048576x32x32x3x16 1048576x32x16x4x16 262144x32x64x4x16 1048576x32x128x4x16 1048576x32x64x4x16 gelu"
ODD="1000x30x64x2x10 777x33x32x3x15 5000x64x16x1x16 gelu 3001x96x64x2x8 3001x32x32x3x16 silu 2048x32x64x4x16 tanh"
export NARROW_GMMA=1
side() { if [ "$1" = B ]; then env ${B_FLAGS:-} "${@:2}"; else env "${@:2}"; fi; }  # side A|B VAR=... command
for r in 1 2; do
  for s in A B; do
    bin="$A"; [ $s = B ] && bin="$B"
    echo "== $s backward, round $r"; side $s NARROW_BWD=1 "$bin" $BWD 2>&1 | grep -E "bwd|FAIL|error"
    echo "== $s forward, round $r"; side $s "$bin" $FWD 2>&1 | grep -E "fwd|FAIL|error"
  done
done
echo "== B, odd cells"; side B NARROW_BWD=1 "$B" $ODD; echo "rc=$?"
echo "== B, odd cells, W as [N, K]"; side B NARROW_BWD=1 NARROW_TRANSPOSED=1 "$B" $ODD | grep -E "FAIL|error"; echo "rc=${PIPESTATUS[0]}"
for t in memcheck racecheck initcheck synccheck; do
  echo "== B under $t"
  side B NARROW_BWD=1 compute-sanitizer --tool $t --error-exitcode 9 "$B" 1000x30x64x2x10 3001x32x32x3x16 2048x32x16x4x16 silu \
    2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAIL|rror" | head -5
  echo "rc=${PIPESTATUS[0]}"
done
echo "== B's wgmma backward under ncu, 2^20 x 64 x 4"
side B NARROW_BWD=1 ncu --kernel-name regex:narrow_mlp_bwd_gmma --launch-count 1 --section SpeedOfLight \
  --section WarpStateStats --section SchedulerStats --section Occupancy --section ComputeWorkloadAnalysis \
  "$B" 1048576x32x64x4x16 2>&1 | grep -v "^==PROF==" | tail -100
