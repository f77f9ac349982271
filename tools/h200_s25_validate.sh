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

case "${1:-}" in
  1) step1 ;;
  *) echo "usage: bash tools/h200_s25_validate.sh 1"; exit 2 ;;
esac
pack "$1"
