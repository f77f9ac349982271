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
#       det at the six shapes with GDN_CORE_DOC_ORDER=0 and =1 (longest-first programs of the
#       state-walking kernels); KCP world 8 with --busy-us 3000 (a stretch is enqueued
#       before it starts, so rank 0 is not charged the host's enqueue time)
#
#   call 5 (no carry; run in session 18 before 2-4): bash tools/h200_s18_validate.sh 5
#       the fused state GPU tests (the first pass's 3-stage ring), its probe at 2 vs 3
#       stages, e2e at the six shapes with the default, GDN_CORE_DOC_ORDER=1 and the Gluon
#       WY forward, the host split at B1 T1024, KCP world 8 with --busy-us 3000
#   call 6 (carry [".whl-base"]), then call 7 right after (carry [".whl"]):
#       bash tools/h200_s18_validate.sh 6 ; bash tools/h200_s18_validate.sh 7
#       6: FlashQLA's base wheels into /tmp/site-base; det profiles at 8 documents of the
#       benchmark's lengths with GDN_CORE_DOC_ORDER unset (the new default: forward walks
#       ordered), 0 and 1; the doc-order GPU tests. 7: det against FlashQLA at the six
#       shapes in one run, then KCP worlds 2 and 4 with --busy-us 3000
#
TAG=s18
source "$(dirname "$0")/h200_lib.sh"

step1() { suite_step; }

step2() { install_base; }

step3() { anchors_step; }

step4() {  # the longest-first order of the fused state backward; KCP without host charging
  e2e order0 "$SHAPES6"
  GDN_CORE_DOC_ORDER=1 e2e order1 "$SHAPES6"
  kcp_in_time 8 "--busy-us 3000"
}

step5() {
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -p gdn_core.pytest_cuda_guard \
    --import-mode=importlib packages/gdn-core/tests/test_gluon_fused_state_bwd_gpu.py \
    packages/gdn-core/tests/test_gluon_fused_state_bwd.py > "$LOG/fused_state_tests.log" 2>&1
  echo "fused state tests exit $?"; tail -3 "$LOG/fused_state_tests.log"
  timeout 120 python3 benchmarks/gluon_fused_state_probe.py --shapes 32768:1,32768:8,65536:16 \
    > "$LOG/fused_state_probe.txt" 2>&1
  echo "probe exit $?"; cut -c1-260 "$LOG/fused_state_probe.txt"
  e2e default "$SHAPES6"
  GDN_CORE_DOC_ORDER=1 e2e order1 "$SHAPES6"
  GDN_CORE_GLUON=grads,fused_state,wy e2e gluon_wy "$SHAPES6"
  timeout 90 python3 benchmarks/host_profile_gpu.py --iters 100 --repeats 5 \
    > "$LOG/host_profile.txt" 2>&1
  echo "host profile exit $?"; tail -30 "$LOG/host_profile.txt" | cut -c1-200
  kcp_in_time 8 "--busy-us 3000"
}

step6() {
  install_base
  for o in unset 0 1; do
    if [[ $o == unset ]]; then unset GDN_CORE_DOC_ORDER; else export GDN_CORE_DOC_ORDER=$o; fi
    timeout 80 python3 benchmarks/profile_gdn.py --shapes 1x32768x16x8,1x32768x16x8x32 \
      --benchmark-lengths --segments 4096 --iters 10 --rows 12 > "$LOG/profile_order_$o.txt" 2>&1
    echo "profile order=$o exit $?"
    grep -E "^===|_kernel " "$LOG/profile_order_$o.txt" | cut -c1-60,150-200
  done
  unset GDN_CORE_DOC_ORDER
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -p gdn_core.pytest_cuda_guard \
    --import-mode=importlib packages/gdn-core/tests/test_doc_order.py \
    > "$LOG/doc_order_tests.log" 2>&1
  echo "doc order tests exit $?"; tail -2 "$LOG/doc_order_tests.log"
}

step7() {
  [[ -d /tmp/site-base ]] || { echo "no /tmp/site-base: call 6 first, right before"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  echo "anchors exit $?"
  local base=$PYTHONPATH
  PYTHONPATH="$base:/tmp/site:/tmp/site-base" timeout 360 python3 benchmarks/bench_gdn_train.py \
    --arms det --compare flashqla --warmup 5 --iters 20 --shapes "$SHAPES6" \
    --acc-shapes "B1,T512,H16" --warm-compile-jobs 6 --json "$LOG/qla.json" > "$LOG/qla.md" 2>&1
  echo "qla exit $?"; grep -E "^\[.*(shape|det |flashqla |warm compile done)" "$LOG/qla.md" | cut -c1-200
  grep -A9 "Against the anchors" "$LOG/qla.md"
  kcp_in_time "2 4" "--busy-us 3000" 60
}

case "${1:-}" in
  1) step1 ;;
  2) step2 ;;
  3) step3 ;;
  4) step4 ;;
  5) step5 ;;
  6) step6 ;;
  7) step7 ;;
  *) echo "usage: bash tools/h200_s18_validate.sh 1|2|3|4|5|6|7"; exit 2 ;;
esac
pack "$1"
