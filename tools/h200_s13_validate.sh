#!/usr/bin/env bash
# Session 13's device calls: the Gluon kernels written in session 12 (WY forward, the state
# forward and backward: GDN_CORE_GLUON stages wy, state, state_bwd), the host-bound loss of
# the Gluon backward at 4K-8K tokens, and what session 12 could not run (layer vs fla, KCP).
#
#   call 1 (~450 s):  bash tools/h200_s13_validate.sh 1
#       GPU tests of every Gluon kernel and of the switch; the Gluon probes; det end to
#       end with the switch off / each stage / all, on five shapes; T8192 where the time
#       goes with the switch off and on (kernel profile, host profile)
#   call 2 (carry [".whl-fla"], ~450 s):  bash tools/h200_s13_validate.sh 2
#       conv and layer against fla (STAGES=layer), KCP worlds 4/8 with and without the
#       busy spin (STAGES=kcp)
#   call 3 (carry [".whl-base"], short), then call 4 (carry [".whl"], ~500 s):
#       bash tools/h200_s13_validate.sh 3 ; bash tools/h200_s13_validate.sh 4
#       det (GDN_CORE_GLUON=$QLA_GLUON, default all; GDN_CORE_BWD_SLAB_TOKENS=$QLA_SLAB,
#       default off: call 1 measured slabs of 8192 at 2.5x the time) against FlashQLA on
#       issue 19's six shapes, HV32 first (session 12's run timed out before it)
#   call 5 (~330 s): bash tools/h200_s13_validate.sh 5   every gpu-marked test, verbose
#   call 6 (~250 s): bash tools/h200_s13_validate.sh 6   probes of the session's kernels;
#       host time at T1024 and end to end with the launch cache on and off
#
# Everything lands in $OUT/s13_<step>.tgz (logs inside). Only -m gpu tests: on a GPU
# machine the interpreter tests see kernels bound to the GPU at import.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/s13"
SRC=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export PYTHONPATH="${SRC%:}"
LOG=$OUT/s13
{ nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$LOG/env.txt" 2>&1
SHAPES6="B1,T32768,H16,HV32,D8;B1,T8192,H16;B1,T32768,H16;B4,T8192,H16;B1,T32768,H16,D8;B1,T65536,H16,D16"

e2e() {  # $1 label, $2 GDN_CORE_GLUON value, $3 shapes (time and peak memory: e2e_<label>.json)
  GDN_CORE_GLUON=$2 timeout 90 python3 benchmarks/bench_gdn_train.py --arms det --warmup 10 \
    --iters 40 --shapes "$3" --acc-shapes none --json "$LOG/e2e_${1//[^A-Za-z0-9_]/_}.json" \
    2>&1 | grep -E "^\[.*(shape|det )" | sed "s/^/$1 /" | tee -a "$LOG/e2e.txt"
}

step1() {
  timeout 240 python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider -p gdn_core.pytest_cuda_guard \
    --import-mode=importlib -ra packages/gdn-core/tests/test_gluon_*.py \
    packages/gdn-core/tests/test_ops_forward.py packages/gdn-core/tests/test_ops_backward.py \
    packages/gdn-core/tests/test_segment.py packages/gdn-core/tests/test_bwd_slabs.py \
    packages/gdn-det-train-kcp/tests/test_det_kcp_gpu.py > "$LOG/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"; grep -E "passed|failed|FAILED|ERROR" "$LOG/gpu_tests.log" | tail -20
  for p in benchmarks/gluon_*_probe.py; do
    timeout 60 python3 "$p" > "$LOG/$(basename "$p" .py).txt" 2>&1
    echo "$p exit $?"; grep -E "gluon|triton" "$LOG/$(basename "$p" .py).txt" | tail -6
  done
  local s5="B1,T4096,H16;B1,T8192,H16;B1,T32768,H16;B1,T32768,H16,D8;B1,T32768,H16,HV32,D8"
  e2e off "" "$s5"; e2e all all "$s5"
  for st in output grads grads2 wy wy_apply state state_bwd dv_local; do
    e2e "$st" "$st" "B1,T32768,H16,D8;B1,T8192,H16"
  done
  GDN_CORE_BWD_SLAB_TOKENS=8192 e2e "slab8192+all" all "$s5"
  e2e off2 "" "$s5"
  for m in off all; do
    local g=""; [[ $m == all ]] && g=all
    (cd benchmarks && GDN_CORE_GLUON=$g timeout 60 python3 profile_gdn.py --shapes 1x8192x16x1 \
      --segments 4096 --iters 20 > "$LOG/profile_T8192_$m.txt" 2>&1)
    GDN_CORE_GLUON=$g timeout 60 python3 benchmarks/host_profile_gpu.py --shape 1,8192,16,128,128 \
      --iters 50 --top 25 > "$LOG/host_profile_T8192_$m.txt" 2>&1
    echo "profiles $m exit $?"
  done
  grep -E "===|kernel|wall" "$LOG"/profile_T8192_*.txt | cut -c1-150 | head -30
}

step2() {
  OUT=$LOG STAGES=layer LAYER_TIMEOUT=${LAYER_TIMEOUT:-300} bash tools/h200_validate.sh
  OUT=$LOG STAGES=kcp KCP_WORLDS="4 8" KCP_TIMEOUT=70 bash tools/h200_validate.sh
  OUT=$LOG/busy STAGES=kcp KCP_WORLDS="4 8" KCP_TIMEOUT=70 KCP_EXTRA="--busy-us 3000" \
    bash tools/h200_validate.sh
}

step3() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-base .whl-base/*.whl
  echo "whl-base exit $?"
}

step4() {
  [[ -d /tmp/site-base ]] || { echo "no /tmp/site-base: run step 3 first, right before"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site-base"
  GDN_CORE_GLUON=${QLA_GLUON-all} GDN_CORE_BWD_SLAB_TOKENS=${QLA_SLAB-} \
    timeout 540 python3 benchmarks/bench_gdn_train.py --arms det \
    --compare flashqla --warmup 5 --iters 20 --shapes "$SHAPES6" --acc-shapes "B1,T512,H16" \
    --json "$LOG/qla.json" > "$LOG/qla.md" 2>&1
  echo "qla exit $?"; grep -E "^\[.*(shape|det |flashqla )" "$LOG/qla.md" | cut -c1-200
}

step5() {  # the GPU tests (every gpu-marked test of the GDN packages), verbose per test
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest -v -n 12 -m gpu -p no:cacheprovider \
    -p gdn_core.pytest_cuda_guard --import-mode=importlib -ra packages/gdn-core/tests \
    packages/gdn-det-train/tests packages/gdn-train/tests packages/gdn-det-train-kcp/tests \
    > "$LOG/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"; grep -cE "PASSED" "$LOG/gpu_tests.log"
  grep -E "FAILED|ERROR|^(FAILED|ERROR) |passed|failed" "$LOG/gpu_tests.log" | sort | uniq | tail -25
}

step6() {  # probes of this session's kernels; host and end-to-end A/B of the launch cache
  for p in benchmarks/gluon_dv_local_probe.py benchmarks/fused_*_probe.py; do
    [[ -f $p ]] || continue
    timeout 70 python3 "$p" > "$LOG/$(basename "$p" .py).txt" 2>&1
    echo "$p exit $?"; grep -vE "^\s*$" "$LOG/$(basename "$p" .py).txt" | tail -8 | cut -c1-220
  done
  for fl in 1 0; do
    GDN_CORE_FAST_LAUNCH=$fl timeout 60 python3 benchmarks/host_overhead_gpu.py --no-fla \
      --no-graph --iters 100 --repeats 3 > "$LOG/host_T1024_fast$fl.txt" 2>&1
    echo "host T1024 fast=$fl exit $?"; grep -E "host|launch" "$LOG/host_T1024_fast$fl.txt"
    GDN_CORE_FAST_LAUNCH=$fl e2e "fast$fl" "" "B1,T8192,H16;B4,T8192,H16;B1,T32768,H16,D8"
  done
  (cd benchmarks && timeout 60 python3 profile_gdn.py --shapes 1x32768x16x8 --segments 4096 \
    --iters 10 > "$LOG/profile_T32768_D8.txt" 2>&1)
  grep -E "===|_kernel" "$LOG/profile_T32768_D8.txt" | awk '{print $1, $(NF-3), $NF}' | head -16
  for v in ${FUSED_ENVS:-}; do  # e.g. FUSED_ENVS="GDN_CORE_FUSED_FWD=1 GDN_CORE_FUSED_BWD=1"
    env "$v" bash -c "$(declare -f e2e); LOG=$LOG; e2e '$v' '' 'B1,T8192,H16;B1,T32768,H16,D8;B1,T32768,H16'"
  done
}

case "${1:-}" in
  1) step1 ;;
  2) step2 ;;
  3) step3 ;;
  4) step4 ;;
  5) step5 ;;
  6) step6 ;;
  *) echo "usage: bash tools/h200_s13_validate.sh 1|2|3|4|5|6"; exit 2 ;;
esac
tar czf "$OUT/s13_${1}.tgz" -C "$OUT" s13 && rm -rf "$OUT/s13"
