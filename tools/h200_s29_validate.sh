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
#   3: carry .whl-base      install_base (nothing else: the next call needs .whl beside it)
#   4: carry .whl           install FlashQLA; Nsight Compute details of one FlashQLA step
#                           (its exact path) and one det step at B1 T32768 H16 in 8
#                           documents (tools/ncu_flashqla_step_once.py); then the gpu-marked
#                           tests of gdn-det-train and the Gluon routing (the env_value change)
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
  3)
    install_base
    pack call3 ;;
  4)
    [[ -d /tmp/site-base ]] || { echo "no /tmp/site-base: call 3 first, right before"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    echo "flashqla install exit $?"
    (export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site-base"
     ncu_details "${NCU_SECONDS:-250}" qs python3 tools/ncu_flashqla_step_once.py)
    gpu_tests gpu_tests.log "${TEST_SECONDS:-120}" 6 packages/gdn-det-train/tests \
      packages/gdn-core/tests/test_gluon_routing.py packages/gdn-core/tests/test_launch_gpu.py
    pack call4 ;;
esac
