#!/usr/bin/env bash
# The next session's device calls (written in session 19, whose device time ran out after
# the group-summed chunk gradients, the document order and the anchors were measured).
#
#   call 1 (~560 s, carry [".old"] after `git worktree add --detach .old 1e6af39`):
#       bash tools/h200_s20_validate.sh 1
#       every gpu-marked test of the four GDN packages at this tree (the group summed in
#       the Gluon chunk-gradient kernel has run its own 39 tests and the 34 grouped-head
#       tests of the alias and det KCP files, not the whole suite), det profiles at
#       segments of 4096, then the CUDA bits against .old
#   (session 20 merged s19-spend-states first and ran call 1 with step 2's benchmark
#   inside it, after the suite and before the bits, in place of the profiles)
#   call 2 (~150 s, no carry), after merging branch s19-spend-states (the running sums in
#   the spent h/dh tiles: compiled, not yet run):
#       bash tools/h200_s20_validate.sh 2
#       the summed kernel's tests and det fwd+bwd (time and peak) at B1 T32768 HV32 8 docs
#       (2802 MiB with the [T, H, 128] fp32 running sums; ~2290 expected without them)
#
TAG=s20
source "$(dirname "$0")/h200_lib.sh"

step2() {
  gpu_tests tests2.log 120 4 -k "group_summed or grouped_heads" \
    packages/gdn-core/tests/test_gluon_chunk_grads_gpu.py
  timeout 60 python3 benchmarks/bench_gdn_train.py --arms det --warmup 3 --iters 10 \
    --shapes "B1,T32768,H16,HV32,D8" --acc-shapes none --json "$LOG/hv32.json" 2>&1 \
    | grep -E "^\[.*(shape|det )|^\| B1" | tee "$LOG/hv32.txt"
}

# call 3 (~420 s, no carry): the Gluon WY forward (in-place inverse, 53 KB: four CTAs an
# SM by shared memory; the 16-bit inverse written by the kernel) -- its GPU tests, the probe
# at two register caps, det fwd+bwd with stage wy on and off; then Nsight Compute on one
# det step at B1 T32768 H16 8 docs (segments of 4096), with the speed-of-light, occupancy,
# launch and warp-state sections, default stages and with wy
ncu_step() {
  gpu_tests wy_tests.log 150 4 packages/gdn-core/tests/test_gluon_wy_gpu.py \
    packages/gdn-core/tests/test_gluon_wy_apply_gpu.py
  timeout 90 python3 benchmarks/gluon_wy_probe.py --docs 1,8 --warps 4 --maxnreg none,128 \
    > "$LOG/wy_probe.txt" 2>&1
  echo "wy probe exit $?"; cat "$LOG/wy_probe.txt"
  E2E_TIMEOUT=80 e2e default "B1,T32768,H16,D8;B1,T32768,H16,HV32,D8"
  GDN_CORE_GLUON=grads,fused_state,wy E2E_TIMEOUT=80 e2e wy "B1,T32768,H16,D8;B1,T32768,H16,HV32,D8"
  local left=$(( ${CALL_LIMIT:-585} - ($(date +%s) - START) ))
  ncu_run $(( left > 150 ? 120 : left - 30 )) ncu_default.txt \
    python3 benchmarks/profile_gdn.py --ncu --shapes 1x32768x16x8 --segments 4096
  echo "ncu default exit $?"
  grep -E "^  [_a-zA-Z].*\(|Duration|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Theoretical Occ" \
    "$LOG/ncu_default.txt" | cut -c1-110 | head -120
  left=$(( ${CALL_LIMIT:-585} - ($(date +%s) - START) ))
  (( left > 60 )) || return 0
  GDN_CORE_GLUON=grads,fused_state,wy ncu_run $(( left - 20 )) ncu_wy_gluon.txt -k regex:wy \
    python3 benchmarks/profile_gdn.py --ncu --shapes 1x32768x16x8 --segments 4096
  echo "ncu wy exit $?"
}

# call 4 (~400 s, carry [".whl-base"]): FlashQLA's base wheels into /tmp (for call 5, made
# right after), every gpu-marked test with wy a default stage, then the WY probe (the fp32
# tile swizzled against bank conflicts)
# call 5 (~450 s, carry [".whl", ".whl-fla"], right after call 4): det against FlashQLA at
# issue 19's six shapes, host time against fla, KCP world 8 if time is left
step4() {
  install_base
  gpu_tests gpu_tests.log 330 12 packages/gdn-core/tests packages/gdn-det-train/tests \
    packages/gdn-train/tests packages/gdn-det-train-kcp/tests
  grep -cE "PASSED" "$LOG/gpu_tests.log"
  timeout 60 python3 benchmarks/gluon_wy_probe.py --docs 8 --warps 4 > "$LOG/wy_probe.txt" 2>&1
  echo "wy probe exit $?"; cat "$LOG/wy_probe.txt"
}

case "${1:-}" in
  1) SUITE_THEN=step2 PROFILE=0 suite_step ;;
  2) step2 ;;
  3) ncu_step ;;
  4) step4 ;;
  5) anchors_step ;;
  *) echo "usage: bash tools/h200_s20_validate.sh 1|2|3|4|5"; exit 2 ;;
esac
pack "$1"
