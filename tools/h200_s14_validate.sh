#!/usr/bin/env bash
# Session 14's device calls (planned in session 13, whose device time ran out). Run them on
# branch `s14-validate`: main + `launchptr` (the launch cache passes tensors as addresses) +
# `fwdsplit` (GDN_CORE_FWD_SPLIT=1: the forward's output off the serial chain) + the WY
# kernel storing the backward's 16-bit inverse itself. Merge what passes into main.
#
#   call 1 (~280 s):  bash tools/h200_s14_validate.sh 1
#       every gpu-marked test of the four GDN packages, verbose (session 13: 368 passed)
#   call 2 (~250 s):  bash tools/h200_s14_validate.sh 2
#       launch cost and host time with the cache on/off; the fused / split forward probes;
#       det end to end at the host-bound shapes and the 32K ones with the switches
#   call 3 (carry [".whl-base"], short), then call 4 right after (carry [".whl"], ~450 s):
#       bash tools/h200_s14_validate.sh 3 ; bash tools/h200_s14_validate.sh 4
#       det against FlashQLA on issue 19's six shapes in one run (HV32 first)
#   call 5 (~250 s):  bash tools/h200_s14_validate.sh 5
#       KCP simulated worlds 2/4/8 at B1 T65536 H16, 16 docs (issue 19 target 4)
#
# Everything lands in $OUT/s14_<step>.tgz (logs inside). Only -m gpu tests on a GPU machine.
# Keep calls back to back: the machine is given back after ~30 s idle, and a cold start
# costs 40-110 s of the session's device time.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/s14"
SRC=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export PYTHONPATH="${SRC%:}"
LOG=$OUT/s14
{ nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$LOG/env.txt" 2>&1
SHAPES6="B1,T32768,H16,HV32,D8;B1,T8192,H16;B1,T32768,H16;B4,T8192,H16;B1,T32768,H16,D8;B1,T65536,H16,D16"

e2e() {  # $1 label, $2 shapes (time and peak memory: e2e_<label>.json); env set by the caller
  timeout 90 python3 benchmarks/bench_gdn_train.py --arms det --warmup 10 --iters 40 \
    --shapes "$2" --acc-shapes none --json "$LOG/e2e_${1//[^A-Za-z0-9_]/_}.json" \
    2>&1 | grep -E "^\[.*(shape|det )" | sed "s/^/$1 /" | tee -a "$LOG/e2e.txt"
}

step1() {
  timeout ${TEST_TIMEOUT:-320} python3 -m pytest -v -n 12 -m gpu -p no:cacheprovider \
    -p gdn_core.pytest_cuda_guard --import-mode=importlib -ra packages/gdn-core/tests \
    packages/gdn-det-train/tests packages/gdn-train/tests packages/gdn-det-train-kcp/tests \
    > "$LOG/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"; grep -cE "PASSED" "$LOG/gpu_tests.log"
  grep -E "^(FAILED|ERROR) |passed|failed" "$LOG/gpu_tests.log" | sort | uniq | tail -25
}

step2() {
  for fl in 1 0; do
    GDN_CORE_FAST_LAUNCH=$fl timeout 60 python3 benchmarks/host_overhead_gpu.py --no-fla \
      --no-graph --iters 100 --repeats 3 > "$LOG/host_T1024_fast$fl.txt" 2>&1
    echo "host T1024 fast=$fl exit $?"; grep -E "host|launch" "$LOG/host_T1024_fast$fl.txt"
  done
  for p in benchmarks/fused_fwd_probe.py benchmarks/fwd_split_probe.py; do
    [[ -f $p ]] || continue
    timeout 70 python3 "$p" > "$LOG/$(basename "$p" .py).txt" 2>&1
    echo "$p exit $?"; grep -vE "^\s*$" "$LOG/$(basename "$p" .py).txt" | tail -8 | cut -c1-220
  done
  local s4="B1,T8192,H16;B4,T8192,H16;B1,T32768,H16;B1,T32768,H16,D8"
  e2e default "$s4"
  GDN_CORE_FAST_LAUNCH=0 e2e fast0 "$s4"
  GDN_CORE_FUSED_FWD=0 e2e fused0 "$s4"
  [[ -f benchmarks/fwd_split_probe.py ]] && GDN_CORE_FWD_SPLIT=1 e2e split1 "$s4"
  GDN_CORE_GLUON=grads e2e gluon_grads "$s4"
}

step3() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-base .whl-base/*.whl
  echo "whl-base exit $?"
}

step4() {
  [[ -d /tmp/site-base ]] || { echo "no /tmp/site-base: run step 3 first, right before"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site-base"
  timeout 540 python3 benchmarks/bench_gdn_train.py --arms det --compare flashqla --warmup 5 \
    --iters 20 --shapes "$SHAPES6" --acc-shapes "B1,T512,H16" --json "$LOG/qla.json" \
    > "$LOG/qla.md" 2>&1
  echo "qla exit $?"; grep -E "^\[.*(shape|det |flashqla )" "$LOG/qla.md" | cut -c1-200
}

step5() {
  OUT=$LOG STAGES=kcp KCP_WORLDS="2 4 8" KCP_TIMEOUT=75 bash tools/h200_validate.sh
}

case "${1:-}" in
  1) step1 ;;
  2) step2 ;;
  3) step3 ;;
  4) step4 ;;
  5) step5 ;;
  *) echo "usage: bash tools/h200_s14_validate.sh 1|2|3|4|5"; exit 2 ;;
esac
tar czf "$OUT/s14_${1}.tgz" -C "$OUT" s14 && rm -rf "$OUT/s14"
