#!/usr/bin/env bash
# The next session's device calls (written at the end of session 24, whose last fused_bwd
# changes — dv over W / dq over v_new, the peak test, the register-budget variants — did not
# reach a GPU). Name kind "nvidia-h200"; an H100 serves for bits and for ratios within a call.
#
#   call 1 (~300 s, no carry):  CALL_LIMIT=560 bash tools/h200_s25_validate.sh 1
#       the fused_bwd GPU tests (bits against the default path with the aliases on and off,
#       the peak-memory drop), the probe's register-budget variants at 32768:8 (the one-tile
#       chunk-gradient kernel alone uncapped / capped at 200 and 168; the fused kernel at
#       S/G 152/176, 168/168, 184/160 with its per-phase stamps: is G's 19 µs of phases the
#       168-register cap?), then det fwd+bwd with and without fused_bwd (time and peak)
TAG=s25
source "$(dirname "$0")/h200_lib.sh"

step1() {
  gpu_tests fused_tests.log 200 4 packages/gdn-core/tests/test_gluon_fused_bwd_gpu.py
  timeout 200 python3 benchmarks/gluon_fused_bwd_probe.py --variants 32768:8 --shapes "" \
    > "$LOG/variants.txt" 2>&1
  echo "variants exit $?"; cat "$LOG/variants.txt"
  local S="B4,T8192,H16;B1,T32768,H16,D8;B1,T32768,H16,HV32,D8"
  unset GDN_CORE_GLUON
  E2E_TIMEOUT=70 e2e default "$S"
  GDN_CORE_GLUON=grads,wy,fused_fwd,fused_state,fused_bwd E2E_TIMEOUT=70 e2e fused_bwd "$S"
}

# call 2: why fused_bwd loses end to end what it wins in the probe: the kernel tables and the
# GPU timelines of det fwd+bwd with and without it, and the probe's pair/fused at 32768:8
step2() {
  for arm in default fused_bwd; do
    if [[ $arm == fused_bwd ]]; then export GDN_CORE_GLUON=grads,wy,fused_fwd,fused_state,fused_bwd
    else unset GDN_CORE_GLUON; fi
    timeout 120 python3 benchmarks/profile_gdn.py --shapes 4x8192x16x1,1x32768x16x8 \
      --segments 4096 --iters 10 --rows 18 > "$LOG/profile_$arm.txt" 2>&1
    echo "profile $arm exit $?"; grep -E "^===|_kernel |gluon|host|wall" "$LOG/profile_$arm.txt" | cut -c1-70,140-210
    timeout 90 python3 benchmarks/profile_gdn.py --gaps --package det --shapes 4x8192x16x1 \
      --iters 10 > "$LOG/gaps_$arm.txt" 2>&1
    echo "gaps $arm exit $?"; head -30 "$LOG/gaps_$arm.txt"
  done
  unset GDN_CORE_GLUON
  timeout 120 python3 benchmarks/gluon_fused_bwd_probe.py --shapes 32768:8 > "$LOG/probe.txt" 2>&1
  echo "probe exit $?"; cat "$LOG/probe.txt"
}

# call 3 (ran at 131ebef; the kernel was removed after it, see docs/fused_backward.md): the
# three-role fused backward (roles Q and K of one warpgroup each beside S): a
# smoke run of the probe (bits against the pair; a hang times out here), the GPU tests with
# both kernels, the register variants with role K's stamps, det fwd+bwd with it
step3() {
  timeout 90 python3 benchmarks/gluon_fused_bwd_probe.py --shapes 8192:2 > "$LOG/smoke.txt" 2>&1
  local rc=$?; echo "smoke exit $rc"; cat "$LOG/smoke.txt" | tail -5
  [[ $rc == 0 ]] || return
  gpu_tests fused_tests3.log 220 6 packages/gdn-core/tests/test_gluon_fused_bwd_gpu.py
  timeout 150 python3 benchmarks/gluon_fused_bwd_probe.py --variants 32768:8 \
    --shapes 32768:8,65536:16,32768:8:g2,32768:8:ln > "$LOG/variants3.txt" 2>&1
  echo "variants exit $?"; cat "$LOG/variants3.txt"
  local S="B4,T8192,H16;B1,T32768,H16,D8;B1,T32768,H16,HV32,D8"
  unset GDN_CORE_GLUON
  E2E_TIMEOUT=60 e2e default "$S"
  GDN_CORE_FUSED_BWD_ROLES=3 GDN_CORE_GLUON=grads,wy,fused_fwd,fused_state,fused_bwd \
    E2E_TIMEOUT=60 e2e fused_bwd3 "$S"
}

# call 4: Nsight Compute's per-instruction stall samples of the two-role fused kernel and of
# the one-tile chunk-gradient kernel (where a chunk's 19 µs of phases go), exported as CSV
step4() {
  NCU_SECTIONS="--section SpeedOfLight --section WarpStateStats --section SourceCounters \
--section LaunchStats --section Occupancy" ncu_run 300 ncu.log -f -o "$LOG/fb" \
    -k regex:"fused_bwd_gluon|chunk_grads_bwd_gluon" python3 tools/ncu_fused_bwd_once.py
  echo "ncu exit $?"; tail -5 "$LOG/ncu.log"
  local ncu; ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout 120 "$ncu" -i "$LOG/fb.ncu-rep" --page details --csv > "$LOG/details.csv" 2>&1
  echo "details exit $?"
  timeout 200 "$ncu" -i "$LOG/fb.ncu-rep" --page source --csv --print-source sass \
    > "$LOG/source.csv" 2>&1
  echo "source exit $? $(wc -c < "$LOG/source.csv") bytes"; head -c 600 "$LOG/source.csv"
  gzip -f "$LOG/source.csv"; rm -f "$LOG/fb.ncu-rep"
}

# calls 5 and 6, back to back (the machine keeps /tmp only while warm):
#   carry [".whl-base"]:          bash tools/h200_s25_validate.sh 5
#   carry [".whl", ".whl-fla"]:   CALL_LIMIT=585 HOST_TIMEOUT=150 bash tools/h200_s25_validate.sh 6
# issue 19's table (det against FlashQLA at the six shapes in one run) and the host time at
# B1 T1024 against fla (issue 18)
step5() { install_base; }
step6() { anchors_step; }

case "${1:-}" in
  1) step1 ;;
  5) step5 ;;
  6) step6 ;;
  4) step4 ;;
  2) step2 ;;
  3) step3 ;;
  *) echo "usage: bash tools/h200_s25_validate.sh 1|2|3|4|5|6"; exit 2 ;;
esac
pack "$1"
