#!/usr/bin/env bash
# The next session's device calls (written at the end of session 26). Name kind "nvidia-h200";
# an H100 often serves (80 GB: the GPU suite on 6 workers, not 12). Back to back, one warm
# window (the machine keeps /tmp only while warm, ~30 s idle):
#
#   call 1, carry [".whl-base"]:           bash tools/h200_s27_validate.sh 1
#   call 2, carry [".whl", ".whl-fla"]:    CALL_LIMIT=585 bash tools/h200_s27_validate.sh 2
#       issue 19's table (det against FlashQLA at the six shapes, one run), then the host at
#       B1 T1024 against fla's Triton kernels alone (--fla-force, no TileLang on its path),
#       with autograd's device thread and with every backward on the calling thread, and
#       the per-piece host costs (host_costs_probe.py)
#   call 3 (no carry, same warm window):   CALL_LIMIT=585 bash tools/h200_s27_validate.sh 3
#       Nsight Compute on one FlashQLA step and one det step (tools/ncu_flashqla_step_once.py:
#       FlashQLA's fused backward beside our backward kernels), then every gpu-marked test
TAG=s27
source "$(dirname "$0")/h200_lib.sh"

step1() { install_base; }

step2() {
  install_anchors || return 1
  local base=$PYTHONPATH
  export PYTHONPATH="$base:/tmp/site:/tmp/site-base"
  timeout 330 python3 benchmarks/bench_gdn_train.py --arms det --compare flashqla --warmup 5 \
    --iters 20 --shapes "$SHAPES6" --acc-shapes "B1,T512,H16" --warm-compile-jobs 6 \
    --json "$LOG/qla.json" > "$LOG/qla.md" 2>&1
  echo "qla exit $?"; grep -E "^\[.*(shape|det |flashqla )" "$LOG/qla.md" | cut -c1-200
  export PYTHONPATH=$base
  host_vs_fla /tmp/site-fla "" --backward-on-caller
  timeout 60 python3 benchmarks/host_costs_probe.py > "$LOG/host_costs.txt" 2>&1
  echo "host costs exit $?"; cat "$LOG/host_costs.txt"
}

step3() {
  [[ -d /tmp/site ]] || { echo "no /tmp/site: run calls 1 and 2 first, in one warm window"; return 1; }
  (export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site-base"
   ncu_details 200 qs python3 tools/ncu_flashqla_step_once.py)
  PROFILE=0 SUITE_WORKERS=${SUITE_WORKERS:-6} TEST_TIMEOUT=360 suite_step
}

case "${1:-}" in
  1) step1 ;;
  2) step2 ;;
  3) step3 ;;
  *) echo "usage: bash tools/h200_s27_validate.sh 1|2|3"; exit 2 ;;
esac
pack "$1"
