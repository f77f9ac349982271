#!/usr/bin/env bash
# Session 28's two device calls, back to back (the machine keeps /tmp only while warm):
#   1: carry .whl-base    install_base, the launch-cost probe, every gpu-marked test of the
#                         four GDN packages on 6 workers (an H100's memory), the host profile
#   2: carry .whl .whl-fla  install_anchors, host time at B1 T1024 against fla's Triton
#                         path (autograd thread; backward on the caller, with our CUDA-graph
#                         replay figure beside it)
export TAG=s28
source tools/h200_lib.sh
case ${1:?call 1 or 2} in
  1)
    install_base
    timeout 60 python3 benchmarks/host_costs_probe.py > "$LOG/host_costs.txt" 2>&1
    echo "costs exit $?"; cat "$LOG/host_costs.txt"
    gpu_tests gpu_tests.log "${TEST_SECONDS:-390}" 6 packages/gdn-core/tests \
      packages/gdn-det-train/tests packages/gdn-train/tests packages/gdn-det-train-kcp/tests
    grep -cE PASSED "$LOG/gpu_tests.log"
    timeout 80 python3 benchmarks/host_profile_gpu.py --iters 50 --top 50 --repeats 3 \
      > "$LOG/host_profile.txt" 2>&1
    echo "profile exit $?"; head -8 "$LOG/host_profile.txt"
    pack call1 ;;
  2)
    install_anchors || exit 1
    host_vs_fla /tmp/site-fla:/tmp/site-base ""
    PYTHONPATH="$PYTHONPATH:/tmp/site-fla:/tmp/site-base" timeout 150 python3 \
      benchmarks/host_overhead_gpu.py --iters 100 --repeats 3 --fla-force --backward-on-caller \
      > "$LOG/host_T1024_fla--backward-on-caller.txt" 2>&1
    echo "host caller+graph exit $?"; grep -vi warning "$LOG/host_T1024_fla--backward-on-caller.txt" | tail -8
    pack call2 ;;
esac
