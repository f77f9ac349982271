#!/usr/bin/env bash
# Session 17's device calls, on main.
#
#   call 1 (~560 s, carry [".old"] after `git worktree add --detach .old b9506db`):
#       bash tools/h200_s17_validate.sh 1
#       every gpu-marked test of the four GDN packages, the fused state backward's included
#       (session 16: its routing test failed, fixed in 677ca51; the alias is now the default);
#       per-kernel profiles of det at B1 T32768 H16 (1 and 8 documents) and B1 T8192; then
#       the det calls' CUDA bits against .old (b9506db, session 16's baseline)
#   call 2 (short, carry [".whl-base"]), then call 3 right after (carry [".whl", ".whl-fla"]):
#       bash tools/h200_s17_validate.sh 2 ; bash tools/h200_s17_validate.sh 3
#       det against FlashQLA on issue 19's six shapes in one run (time, peak memory), the
#       opt-in probes, host time at B1 T1024 against fla (tilelang importable, so fla 0.6.0
#       runs on Triton 3.6 on Hopper), KCP world 8 with 20 iterations
#
#   call 4 (carry [".whl-base"]) then call 5 right after (carry [".whl", ".whl-fla"]):
#       the fused state GPU tests (now also in the segment backward's first pass), det at
#       the six shapes with and without GDN_CORE_GLUON=grads,fused_state; host time at
#       B1 T1024 against fla (its first call compiles its kernels: give it 240 s)
#
# Everything lands in $OUT/s17_<step>.tgz (logs inside). Keep calls back to back: the machine
# is given back after ~30 s idle and /tmp/site* go with it.
TAG=s17
source "$(dirname "$0")/h200_lib.sh"

step1() { suite_step; }

step2() { install_base; }

step3() { anchors_step; }

step4() {  # (carry [".whl-base"]) the fused state stage in both reverse passes of det
  step2
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -p gdn_core.pytest_cuda_guard \
    packages/gdn-core/tests/test_gluon_fused_state_bwd_gpu.py > "$LOG/fused_state_tests.log" 2>&1
  echo "fused state tests exit $?"; tail -3 "$LOG/fused_state_tests.log"
  e2e default "$SHAPES6"
  GDN_CORE_GLUON=grads,fused_state e2e fused_state "$SHAPES6"
}

step5() {  # (carry [".whl", ".whl-fla"], right after step 4) host time against fla
  install_anchors || return 1
  PYTHONPATH="$PYTHONPATH:/tmp/site-fla:/tmp/site-base:/tmp/site" timeout ${HOST_TIMEOUT:-240} \
    python3 benchmarks/host_overhead_gpu.py --no-graph --iters 100 --repeats 3 \
    > "$LOG/host_T1024_fla.txt" 2>&1
  echo "host exit $?"; cat "$LOG/host_T1024_fla.txt"
}

case "${1:-}" in
  1) step1 ;;
  2) step2 ;;
  3) step3 ;;
  4) step4 ;;
  5) step5 ;;
  *) echo "usage: bash tools/h200_s17_validate.sh 1|2|3|4|5"; exit 2 ;;
esac
pack "$1"
