#!/usr/bin/env bash
# Session 29's device calls, back to back (the machine keeps /tmp only while warm):
#   1: carry .whl-base      install_base; every gpu-marked test of the four GDN packages on 6
#                           workers with the one-launch recompute a default stage; then det
#                           fwd+bwd at the single-long-document shapes per segment size
#                           (det = 4096, det-s2048, det-s1024, det-plain = none)
#   2: carry .whl .whl-fla  install_anchors; issue 19's table (det against FlashQLA at the six
#                           shapes, one run); issue 18's host time at B1 T1024 against fla's
#                           Triton kernels (autograd's device thread; backward on the caller,
#                           with the CUDA-graph replay beside it); the per-piece host costs
export TAG=s29
source tools/h200_lib.sh
case ${1:?call 1 or 2} in
  1)
    install_base
    gpu_tests gpu_tests.log "${TEST_SECONDS:-360}" 6 packages/gdn-core/tests \
      packages/gdn-det-train/tests packages/gdn-train/tests packages/gdn-det-train-kcp/tests
    grep -cE PASSED "$LOG/gpu_tests.log"
    timeout 170 python3 benchmarks/bench_gdn_train.py --arms det,det-s2048,det-s1024,det-plain \
      --warmup 5 --iters 20 --shapes "B1,T8192,H16;B1,T32768,H16;B4,T8192,H16" \
      --acc-shapes none --json "$LOG/segments.json" > "$LOG/segments.md" 2>&1
    echo "segments exit $?"; grep -E "^\[.*(shape|det)" "$LOG/segments.md" | cut -c1-160
    pack call1 ;;
  2)
    install_anchors || exit 1
    base=$PYTHONPATH
    export PYTHONPATH="$base:/tmp/site:/tmp/site-base"
    timeout 330 python3 benchmarks/bench_gdn_train.py --arms det --compare flashqla --warmup 5 \
      --iters 20 --shapes "$SHAPES6" --acc-shapes "B1,T512,H16" --warm-compile-jobs 6 \
      --json "$LOG/qla.json" > "$LOG/qla.md" 2>&1
    echo "qla exit $?"; grep -E "^\[.*(shape|det |flashqla )" "$LOG/qla.md" | cut -c1-200
    export PYTHONPATH=$base
    host_vs_fla /tmp/site-fla:/tmp/site-base ""
    PYTHONPATH="$PYTHONPATH:/tmp/site-fla:/tmp/site-base" timeout 150 python3 \
      benchmarks/host_overhead_gpu.py --iters 100 --repeats 3 --fla-force --backward-on-caller \
      > "$LOG/host_T1024_fla--backward-on-caller.txt" 2>&1
    echo "host caller+graph exit $?"
    grep -vi warning "$LOG/host_T1024_fla--backward-on-caller.txt" | tail -8
    timeout 60 python3 benchmarks/host_costs_probe.py > "$LOG/host_costs.txt" 2>&1
    echo "costs exit $?"; cat "$LOG/host_costs.txt"
    pack call2 ;;
esac
