#!/usr/bin/env bash
# The next session's device calls, on main (written in session 17, which ran out of device
# time after measuring the fused state stage and making it a default where it pays).
#
#   call 1 (~560 s, carry [".old"] after `git worktree add --detach .old b9506db`):
#       bash tools/h200_s18_validate.sh 1
#       every gpu-marked test of the four GDN packages with the new defaults (fused_state
#       at >= 96 programs; never run as a default yet), the fused state file included (its
#       new GDN_CORE_DOC_ORDER test); det profiles; then the CUDA bits against .old
#   call 2 (short, carry [".whl-base"]), then call 3 right after (carry [".whl", ".whl-fla"]):
#       bash tools/h200_s18_validate.sh 2 ; bash tools/h200_s18_validate.sh 3
#       det against FlashQLA on issue 19's six shapes in one run (time, peak), host time
#       against fla, KCP world 8 (20 iterations)
#   call 4 (no carry): bash tools/h200_s18_validate.sh 4
#       det at the six shapes with GDN_CORE_DOC_ORDER=0 and =1 (longest-first programs of
#       the fused state backward); KCP world 8 with --busy-us 3000 (a stretch is enqueued
#       before it starts, so rank 0 is not charged the host's enqueue time)
#
TAG=s18
source "$(dirname "$0")/h200_lib.sh"

step1() {
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest -v -n 12 -m gpu -p no:cacheprovider \
    -p gdn_core.pytest_cuda_guard --import-mode=importlib -ra packages/gdn-core/tests \
    packages/gdn-det-train/tests packages/gdn-train/tests packages/gdn-det-train-kcp/tests \
    > "$LOG/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"; grep -cE "PASSED" "$LOG/gpu_tests.log"
  grep -E "^(FAILED|ERROR) |passed|failed" "$LOG/gpu_tests.log" | sort | uniq | tail -25
  timeout 90 python3 benchmarks/profile_gdn.py --shapes 1x32768x16x8,1x32768x16x1,1x8192x16x1 \
    --segments 4096 --iters 10 --rows 16 > "$LOG/profile_det.txt" 2>&1
  echo "profile exit $?"; grep -E "^===|_kernel " "$LOG/profile_det.txt" | cut -c1-60,150-200
  local left=$(( ${CALL_LIMIT:-585} - ($(date +%s) - START) ))
  echo "bits with ${left} s left"
  OUT=$LOG STAGES=bits BITS_TIMEOUT=$(( left > 60 ? left - 50 : 10 )) bash tools/h200_validate.sh
}

step2() { install_base; }

step3() {
  install_anchors || return 1
  local base=$PYTHONPATH
  export PYTHONPATH="$base:/tmp/site:/tmp/site-base"
  timeout 400 python3 benchmarks/bench_gdn_train.py --arms det --compare flashqla --warmup 5 \
    --iters 20 --shapes "$SHAPES6" --acc-shapes "B1,T512,H16" --warm-compile-jobs 6 \
    --json "$LOG/qla.json" > "$LOG/qla.md" 2>&1
  echo "qla exit $?"; grep -E "^\[.*(shape|det |flashqla |warm compile done)" "$LOG/qla.md" | cut -c1-200
  PYTHONPATH="$base:/tmp/site-fla:/tmp/site-base:/tmp/site" timeout ${HOST_TIMEOUT:-230} python3 \
    benchmarks/host_overhead_gpu.py --no-graph --iters 100 --repeats 3 > "$LOG/host_T1024_fla.txt" 2>&1
  echo "host exit $?"; cat "$LOG/host_T1024_fla.txt"
  [[ -n ${S3_PROBES:-} ]] && for p in $S3_PROBES; do
    timeout 90 python3 "benchmarks/$p" > "$LOG/${p%.py}.txt" 2>&1
    echo "$p exit $?"; cut -c1-200 "$LOG/${p%.py}.txt" | tail -24
  done
  local left=$(( ${CALL_LIMIT:-585} - ($(date +%s) - START) ))
  if (( left > 100 )); then
    OUT=$LOG STAGES=kcp KCP_WORLDS="8" KCP_TIMEOUT=$(( left - 20 )) \
      KCP_EXTRA="--warmup 3 --iters 20" bash tools/h200_validate.sh
  else echo "no time left for KCP (${left} s)"; fi
}

step4() {  # the longest-first order of the fused state backward; KCP without host charging
  e2e order0 "$SHAPES6"
  GDN_CORE_DOC_ORDER=1 e2e order1 "$SHAPES6"
  OUT=$LOG STAGES=kcp KCP_WORLDS="8" KCP_TIMEOUT=150 \
    KCP_EXTRA="--warmup 3 --iters 20 --busy-us 3000" bash tools/h200_validate.sh
}

case "${1:-}" in
  1) step1 ;;
  2) step2 ;;
  3) step3 ;;
  4) step4 ;;
  *) echo "usage: bash tools/h200_s18_validate.sh 1|2|3|4"; exit 2 ;;
esac
pack "$1"
