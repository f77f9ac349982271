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

# call 2 (~480 s, carry [".whl-base"]), after fused_fwd and GLUON_WY_MERGE_K = 16 became
# defaults: FlashQLA's base wheels into /tmp (for call 3, made right after), every
# gpu-marked test, then the GPU timeline of det steps as the benchmark times them (busy,
# idle, the longest gaps: whether the step waits on the host)
#       CALL_LIMIT=560 bash tools/h200_s21_validate.sh 2
# call 3 (~560 s, carry [".whl", ".whl-fla"], right after call 2): det against FlashQLA at
# issue 19's six shapes, both kernel tables and timelines at B1 T32768 8 docs, host time
# against fla, KCP world 8 if time is left
#       CALL_LIMIT=580 HOST_TIMEOUT=200 bash tools/h200_s21_validate.sh 3
GAP_SHAPES="4x8192x16x1,1x32768x16x8,1x32768x16x8x32"

timelines() {  # timelines ARM LOGFILE: profile_gdn.py --gaps at GAP_SHAPES (uneven documents)
  timeout 120 python3 benchmarks/profile_gdn.py --gaps --package "$1" --shapes "$GAP_SHAPES" \
    --benchmark-lengths --iters 10 --rows 6 > "$LOG/$2" 2>&1
  echo "timelines $1 exit $?"; cat "$LOG/$2" | grep -v Warning | tail -24
}

step2() {
  install_base
  gpu_tests gpu_tests.log 330 12 packages/gdn-core/tests packages/gdn-det-train/tests \
    packages/gdn-train/tests packages/gdn-det-train-kcp/tests
  grep -cE "PASSED" "$LOG/gpu_tests.log"
  timelines det timelines_det.txt
}

step3() {
  install_anchors || return 1
  local base=$PYTHONPATH
  export PYTHONPATH="$base:/tmp/site:/tmp/site-base"
  timeout 360 python3 benchmarks/bench_gdn_train.py --arms det --compare flashqla --warmup 5 \
    --iters 20 --shapes "$SHAPES6" --acc-shapes "B1,T512,H16" --warm-compile-jobs 6 \
    --json "$LOG/qla.json" > "$LOG/qla.md" 2>&1
  echo "qla exit $?"; grep -E "^\[.*(shape|det |flashqla |warm compile done)" "$LOG/qla.md" | cut -c1-200
  for arm in det flashqla; do  # the kernel tables side by side, 8 uneven documents
    timeout 60 python3 benchmarks/profile_gdn.py --package $arm --shapes 1x32768x16x8 \
      --benchmark-lengths --iters 10 --rows 14 > "$LOG/kernels_$arm.txt" 2>&1
    echo "kernels $arm exit $?"; grep -E "^===|  " "$LOG/kernels_$arm.txt" | cut -c1-70,150-210 | head -20
  done
  timelines flashqla timelines_flashqla.txt
  PYTHONPATH="$base:/tmp/site-fla:/tmp/site-base:/tmp/site" timeout ${HOST_TIMEOUT:-230} python3 \
    benchmarks/host_overhead_gpu.py --no-graph --iters 100 --repeats 3 > "$LOG/host_T1024_fla.txt" 2>&1
  echo "host exit $?"; cat "$LOG/host_T1024_fla.txt"
  kcp_in_time 8
}

# call 4 (~200 s, no carry): the backward's one-launch recompute (stage recompute: W and U
# formed on chip, h and v_new stored; named only): its GPU tests (bits against wy_apply +
# chunk_state_fwd, the det API with it named), its probe, then det fwd+bwd without it and
# with it at B4 T8192, B1 T32768 8 docs and HV32 8 docs, in what is left of CALL_LIMIT
#       CALL_LIMIT=230 bash tools/h200_s21_validate.sh 4
step4() {
  gpu_tests recompute_tests.log 110 4 packages/gdn-core/tests/test_gluon_recompute_gpu.py
  local rc=$?
  (( rc == 124 )) && { echo "the recompute's tests timed out: its probe and A/B skipped"; return 0; }
  timeout 40 python3 benchmarks/gluon_recompute_probe.py --docs 8 > "$LOG/recompute_probe.txt" 2>&1
  echo "probe exit $?"; cat "$LOG/recompute_probe.txt"
  local S="B4,T8192,H16;B1,T32768,H16,D8;B1,T32768,H16,HV32,D8"
  local left=$(( ${CALL_LIMIT:-585} - ($(date +%s) - START) ))
  (( left > 60 )) || { echo "no time left for the A/B (${left} s)"; return 0; }
  E2E_TIMEOUT=$(( left / 2 - 5 )) e2e off "$S"
  GDN_CORE_GLUON=grads,fused_state,wy,fused_fwd,recompute E2E_TIMEOUT=$(( left / 2 - 5 )) e2e on "$S"
}

case "${1:-}" in
  1) step1 ;;
  2) step2 ;;
  3) step3 ;;
  4) step4 ;;
  *) echo "usage: bash tools/h200_s21_validate.sh 1|2|3|4"; exit 2 ;;
esac
pack "$1"
