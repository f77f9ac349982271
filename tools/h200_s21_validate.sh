#!/usr/bin/env bash
# The next session's first device call (written in session 20, whose device time ran out
# after the warp-specialised Gluon fused forward compiled but before it ran):
#
#   call 1 (~330 s, no carry):
#       CALL_LIMIT=560 bash tools/h200_s21_validate.sh 1
#       the fused forward's GPU tests (bits against the Triton fused forward, walk order,
#       documents alone, NaN containment), its probe against the Triton fused kernel (1 and
#       8 documents in segments of 4096), the WY with its merge in slices of 16 (bits, time),
#       the host profile at B1 T1024, then det fwd+bwd with the stage on and off,
#       alternating, at B4 T8192, B1 T32768 8 docs and HV32 8 docs
#   if it is bitwise equal and faster: add "fused_fwd" to DEFAULT_STAGES (and out of
#   BY_NAME_ONLY), then session 20's calls 4-5 (tools/h200_s20_validate.sh 4, 5): the whole
#   suite and the anchors
TAG=s21
source "$(dirname "$0")/h200_lib.sh"

step1() {
  gpu_tests fused_fwd_tests.log 150 4 packages/gdn-core/tests/test_gluon_fused_fwd_gpu.py
  local rc=$?
  if (( rc == 124 )); then  # a hang (an mbarrier wait that never completes): skip its runs
    echo "the fused forward's tests timed out: its probe and A/B skipped"
  else
    fused_fwd_runs
  fi
  wy_and_host_runs
}

fused_fwd_runs() {
  timeout 100 python3 benchmarks/fused_fwd_probe.py --docs 1,8 --variants "" --gluon \
    > "$LOG/fused_fwd_probe.txt" 2>&1
  echo "probe exit $?"; cat "$LOG/fused_fwd_probe.txt"
  local S="B4,T8192,H16;B1,T32768,H16,D8;B1,T32768,H16,HV32,D8"
  local ON=grads,fused_state,wy,fused_fwd
  E2E_TIMEOUT=80 e2e off1 "$S"
  GDN_CORE_GLUON=$ON E2E_TIMEOUT=80 e2e on1 "$S"
  E2E_TIMEOUT=60 e2e off2 "$S"
  GDN_CORE_GLUON=$ON E2E_TIMEOUT=60 e2e on2 "$S"
}

wy_and_host_runs() {
  # the swizzled WY with its 32x32 merge in slices of 16 (106 registers: four CTAs an SM;
  # the same bits, tested here too); if faster, GLUON_WY_MERGE_K = 16
  gpu_tests wy_merge_tests.log 90 2 -k merge_depth packages/gdn-core/tests/test_gluon_wy_gpu.py
  timeout 45 python3 benchmarks/gluon_wy_probe.py --docs 8 --warps 4 --merge-k 32,16 \
    > "$LOG/wy_probe.txt" 2>&1
  echo "wy probe exit $?"; cat "$LOG/wy_probe.txt"
  # where a det call's host time goes at B1 T1024 (issue 18; the stubbed-launch CPU figure
  # is ~0.2 ms of it), in what is left of the call
  local left=$(( ${CALL_LIMIT:-585} - ($(date +%s) - START) ))
  (( left > 50 )) || { echo "no time left for the host profile"; return 0; }
  timeout $(( left - 10 )) python3 benchmarks/host_profile_gpu.py --iters 50 --top 30 \
    > "$LOG/host_profile_T1024.txt" 2>&1
  echo "host profile exit $?"; grep -E "ms|per step" "$LOG/host_profile_T1024.txt" | head -12
}

# call 2 (~60 s, carry [".whl-base"]): FlashQLA's base wheels into /tmp (install_base)
# call 3 (~300 s, carry [".whl", ".whl-fla"], right after call 2): Nsight Compute on one
# FlashQLA step at B1 T32768 H16 8 equal docs (the per-kernel profile beside ours of session
# 20: the same sections and inputs); the anchors themselves: session 20's call 5 pattern
step3() {
  install_anchors || return 1
  PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site-base" ncu_run 200 ncu_flashqla.txt \
    python3 benchmarks/profile_gdn.py --ncu --package flashqla --shapes 1x32768x16x8
  echo "ncu flashqla exit $?"
  grep -E "^  [_a-zA-Z].*\(|Duration|Achieved Occupancy|Issue Slots Busy|DRAM Throughput" \
    "$LOG/ncu_flashqla.txt" | cut -c1-110 | head -60
}

case "${1:-}" in
  1) step1 ;;
  2) install_base ;;
  3) step3 ;;
  *) echo "usage: bash tools/h200_s21_validate.sh 1|2|3"; exit 2 ;;
esac
pack "$1"
