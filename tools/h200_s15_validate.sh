#!/usr/bin/env bash
# The next session's device calls, on main. Session 14 made the Gluon chunk-gradient kernel
# the default (GDN_CORE_GLUON unset = grads) without a full GPU suite under it, and merged
# what its helpers built (see the session 14 note); call 1 checks all of it.
#
#   call 1 (~280 s):  bash tools/h200_s15_validate.sh 1
#       every gpu-marked test of the four GDN packages, verbose (session 14: 369 passed,
#       2 failed in the unmerged split forward)
#   call 2 (short, carry [".whl-base"]), then call 3 right after (carry [".whl"], ~400 s):
#       bash tools/h200_s15_validate.sh 2 ; bash tools/h200_s15_validate.sh 3
#       det (the new default) against FlashQLA on issue 19's six shapes in one run; FlashQLA
#       compiles its TileLang kernels for each shape first, 6 processes at once
#       (--warm-compile-jobs: session 14's serial compiles ran past one call's limit);
#       then det with GDN_CORE_GLUON=none at the same shapes (the A/B of the default)
#   call 4 (~300 s, carry [".old"] after `git worktree add .old b9506db`):
#       bash tools/h200_s15_validate.sh 4
#       KCP simulated worlds 2/4/8 (issue 19 target 4) under the new default; the det
#       calls' CUDA bits of main against b9506db (before the fewer-launches merge: the
#       paired L2 norm and the fold changes must keep the bits); the kernel profile at B1
#       T32768 8 documents; host time at T1024
#   call 6 (~230 s, carry [".old"] after `git -C .old checkout --detach 9eb52c5`), on branch
#       s15-final (main + wyfast): bash tools/h200_s15_validate.sh 6
#       the fixed Gluon routing test; det at the packed-document shapes with this tree and
#       with .old (before cu_seqlens was read once per tensor object); the WY register
#       inverse's probe and GPU test (GDN_CORE_WY_INV=reg). Logs go straight to $OUT.
#       (Session 14's branch fwdinline, planned here, did not survive into this checkout.)
#   call 5 (~300 s, carry [".whl-fla"]):  bash tools/h200_s15_validate.sh 5
#       the layer against fla's (issue 21 target 3; session 13: det / fla 0.85-1.05), the
#       packed-document shape twice (fla's layer autotunes at its first shape)
#
# Everything lands in $OUT/s15_<step>.tgz (logs inside). Only -m gpu tests on a GPU machine.
# Keep calls back to back: the machine is given back after ~30 s idle, and a cold start
# costs 40-110 s of the session's device time.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/s15"
SRC=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export PYTHONPATH="${SRC%:}"
LOG=$OUT/s15
{ nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$LOG/env.txt" 2>&1
SHAPES6="B1,T32768,H16,HV32,D8;B1,T8192,H16;B1,T32768,H16;B4,T8192,H16;B1,T32768,H16,D8;B1,T65536,H16,D16"

e2e() {  # $1 label, $2 shapes (time and peak memory: e2e_<label>.json); env set by the caller
  timeout 90 python3 benchmarks/bench_gdn_train.py --arms det --warmup ${E2E_WARMUP:-10} --iters ${E2E_ITERS:-40} \
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
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-base .whl-base/*.whl
  echo "whl-base exit $?"
}

step3() {
  [[ -d /tmp/site-base ]] || { echo "no /tmp/site-base: run step 2 first, right before"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site-base"
  timeout 420 python3 benchmarks/bench_gdn_train.py --arms det --compare flashqla --warmup 5 \
    --iters 20 --shapes "$SHAPES6" --acc-shapes "B1,T512,H16" --warm-compile-jobs 6 \
    --json "$LOG/qla.json" > "$LOG/qla.md" 2>&1
  echo "qla exit $?"; grep -E "^\[.*(shape|det |flashqla |warm compile done)" "$LOG/qla.md" | cut -c1-200
  GDN_CORE_GLUON=none e2e gluon_none "$SHAPES6"
}

step4() {
  OUT=$LOG STAGES="kcp bits" KCP_WORLDS="2 4 8" KCP_TIMEOUT=75 bash tools/h200_validate.sh
  (cd benchmarks && timeout 60 python3 profile_gdn.py --shapes 1x32768x16x8 \
    > "$LOG/profile_T32768_D8.txt" 2>&1); echo "profile exit $?"
  tail -25 "$LOG/profile_T32768_D8.txt" | cut -c1-160
  timeout 60 python3 benchmarks/host_overhead_gpu.py --no-fla --no-graph --iters 100 \
    --repeats 3 > "$LOG/host_T1024.txt" 2>&1; echo "host exit $?"; cat "$LOG/host_T1024.txt"
}

step5() {
  OUT=$LOG STAGES=layer CONV_TIMEOUT=60 LAYER_SHAPES="1:32768:8 1:32768 4:8192 1:8192 1:32768:8" \
    LAYER_TIMEOUT=420 bash tools/h200_validate.sh
}

step6() {
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu -p gdn_core.pytest_cuda_guard \
    packages/gdn-core/tests/test_gluon_routing.py > "$LOG/routing_tests.log" 2>&1
  echo "routing tests exit $?"; tail -2 "$LOG/routing_tests.log"
  local packed="B1,T32768,H16,D8;B1,T65536,H16,D16;B1,T32768,H16,HV32,D8"
  e2e new "$packed"
  local old; old=$(ls -d "$PWD"/.old/packages/*/src 2>/dev/null | tr '\n' ':')
  if [[ -n $old ]]; then PYTHONPATH="${old%:}" e2e old "$packed"; else echo "no .old carried"; fi
  [[ -f benchmarks/wy_inverse_probe.py ]] || { echo "not on a tree with wyfast"; return 1; }
  timeout 90 python3 benchmarks/wy_inverse_probe.py > "$LOG/wy_inverse_probe.txt" 2>&1
  echo "wy probe exit $?"; cut -c1-200 "$LOG/wy_inverse_probe.txt" | tail -24
  [[ ${WY_TESTS:-0} == 1 ]] || return 0  # the GPU test compiles for 60-120 s
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -p gdn_core.pytest_cuda_guard \
    packages/gdn-core/tests/test_wy_inverse_gpu.py > "$LOG/wy_inverse_gpu.log" 2>&1
  echo "wy gpu tests exit $?"; tail -3 "$LOG/wy_inverse_gpu.log"
}

case "${1:-}" in
  1) step1 ;;
  2) step2 ;;
  3) step3 ;;
  4) step4 ;;
  5) step5 ;;
  6) step6 ;;
  *) echo "usage: bash tools/h200_s15_validate.sh 1|2|3|4|5|6"; exit 2 ;;
esac
tar czf "$OUT/s15_${1}.tgz" -C "$OUT" s15 && rm -rf "$OUT/s15"
