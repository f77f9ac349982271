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
TAG=s18
source "$(dirname "$0")/h200_lib.sh"

step1() { suite_step; }

step2() { install_base; }

step3() { anchors_step; }

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
