#!/usr/bin/env bash
# The next session's device calls (written in session 23, which had no device: nothing of
# session 23 has run on a GPU). Name kind "nvidia-h200" (every anchor figure is an H200's).
#
#   call 1 (~450 s, no carry):  CALL_LIMIT=560 bash tools/h200_s24_validate.sh 1
#       the Gluon WY tests (session 23 moved the WY forward's and WY apply's launch
#       arguments from keywords to positions: the fast launch path; the same kernel, the
#       same bits), host time at B1 T1024 with the launches that still went through
#       Triton's binding listed (none expected; unpinned and pinned to one CPU), then
#       session 22's timelines with the recompute stage off and on, twice, and one
#       end-to-end pair: does the 16-head idle time with the recompute persist?
#   call 2 (~420 s, carry [".whl-base"]), from branch `recompute-default` (recompute among
#   DEFAULT_STAGES, its tests updated: `git checkout recompute-default` here first):
#       CALL_LIMIT=560 bash tools/h200_s24_validate.sh 2
#       every gpu-marked test with the default stages (GDN_CORE_GLUON unset). Green and call
#       1 showing the kernels faster: merge the branch into main.
#   call 3 (~560 s, carry [".whl", ".whl-fla"], right after call 2; still on the branch if
#   call 2 was green, so that the table is the new default's):
#       CALL_LIMIT=590 HOST_TIMEOUT=150 HOST_PIN=2 bash tools/h200_s21_validate.sh 3
#       det against FlashQLA (all six shapes, one run), kernel tables, host against fla
#       unpinned and pinned to one CPU (issue 18's ratio both ways)
#   call F (~480 s, no carry; session 24's fused backward, stage fused_bwd):
#       CALL_LIMIT=560 bash tools/h200_s24_validate.sh fused
#       a one-shape smoke run of benchmarks/gluon_fused_bwd_probe.py first (a deadlocked
#       mbarrier protocol would hang: 90 s cap), then its four shapes (ms against
#       fused_state + grads, bits), the fused_bwd GPU tests with the chunk-gradient, WY and
#       launch ones, and det fwd+bwd end to end with the default stages and with fused_bwd
#       (E2E=0 skips it; FUSED_TESTS_MORE adds test paths; the probe prints the --stamps
#       breakdown at 32768:8)
TAG=s24
source "$(dirname "$0")/h200_lib.sh"

step1() {
  gpu_tests wy_tests.log 120 4 packages/gdn-core/tests/test_gluon_wy_gpu.py \
    packages/gdn-core/tests/test_gluon_wy_apply_gpu.py packages/gdn-core/tests/test_launch_gpu.py
  timeout 100 python3 benchmarks/host_overhead_gpu.py --no-fla --iters 100 --repeats 5 \
    > "$LOG/host_T1024.txt" 2>&1
  echo "host exit $?"; cat "$LOG/host_T1024.txt"
  timeout 60 python3 benchmarks/host_overhead_gpu.py --no-fla --iters 100 --repeats 5 --pin 2 \
    > "$LOG/host_T1024_pinned.txt" 2>&1
  echo "host pinned exit $?"; cat "$LOG/host_T1024_pinned.txt"
  local on=grads,fused_state,wy,fused_fwd,recompute
  # session 22's timelines, alternating twice: its 16-head idle difference (0.7-0.9 ms) was
  # within that call's host noise (the same arm's end-to-end repeats moved by up to 1.2 ms)
  for mode in off on off2 on2; do
    if [[ $mode == on* ]]; then export GDN_CORE_GLUON=$on; else unset GDN_CORE_GLUON; fi
    timeout 90 python3 benchmarks/profile_gdn.py --gaps --package det \
      --shapes 4x8192x16x1,1x32768x16x8,1x32768x16x8x32 --benchmark-lengths --iters 10 \
      --rows 6 > "$LOG/timelines_$mode.txt" 2>&1
    echo "timelines $mode exit $?"; grep -E "===|timeline|idle" "$LOG/timelines_$mode.txt" | head -24
  done
  unset GDN_CORE_GLUON
  local S="B4,T8192,H16;B1,T32768,H16,D8;B1,T32768,H16,HV32,D8"
  E2E_TIMEOUT=50 e2e off1 "$S"
  GDN_CORE_GLUON=$on E2E_TIMEOUT=50 e2e on1 "$S"
}

step2() {
  install_base  # FlashQLA's base wheels into /tmp for call 3, made right after
  unset GDN_CORE_GLUON
  gpu_tests gpu_tests.log 330 12 packages/gdn-core/tests packages/gdn-det-train/tests \
    packages/gdn-train/tests packages/gdn-det-train-kcp/tests
  grep -cE "PASSED" "$LOG/gpu_tests.log"
  git log --oneline -1 > "$LOG/branch.txt" 2>&1
}

step_fused() {
  timeout 90 python3 benchmarks/gluon_fused_bwd_probe.py --shapes 8192:2 > "$LOG/smoke.txt" 2>&1
  local rc=$?
  echo "smoke exit $rc"; tail -5 "$LOG/smoke.txt"
  if (( rc == 0 )); then
    timeout 150 python3 benchmarks/gluon_fused_bwd_probe.py --stamps 32768:8 \
      > "$LOG/probe.txt" 2>&1
    echo "probe exit $?"; cat "$LOG/probe.txt"
  fi
  gpu_tests fused_tests.log 200 4 packages/gdn-core/tests/test_gluon_fused_bwd_gpu.py \
    packages/gdn-core/tests/test_gluon_chunk_grads_gpu.py ${FUSED_TESTS_MORE:-}
  if (( rc == 0 )) && [[ ${E2E:-1} == 1 ]]; then
    local S="B4,T8192,H16;B1,T32768,H16;B1,T32768,H16,D8;B1,T65536,H16,D16"
    unset GDN_CORE_GLUON
    E2E_TIMEOUT=70 e2e default "$S"
    GDN_CORE_GLUON=grads,wy,fused_fwd,fused_state,fused_bwd E2E_TIMEOUT=70 e2e fused_bwd "$S"
  fi
}

case "${1:-}" in
  1) step1 ;;
  fused) step_fused ;;
  2) step2 ;;
  *) echo "usage: bash tools/h200_s24_validate.sh 1|2|fused (call 3: see the header)"; exit 2 ;;
esac
pack "$1"
