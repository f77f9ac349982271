#!/usr/bin/env bash
# The next session's device calls (written in session 18, whose device time ran out after
# the fused state default, the forward order and the anchors were measured).
#
#   call 1 (~560 s, carry [".old"] after `git worktree add --detach .old 92ac479`):
#       bash tools/h200_s19_validate.sh 1
#       every gpu-marked test of the four GDN packages at this tree (the forward walks
#       longest first by default and the first pass's 3-stage ring: neither has run the
#       whole suite yet), det profiles at 8 documents of the benchmark's lengths with
#       GDN_CORE_DOC_ORDER unset, 0 and 1 (which kernel lost 0.24 ms at 8 docs with every
#       walk ordered), whether a wgmma's bits depend on where its A operand comes from or on
#       the accumulator's sign (benchmarks/wgmma_operand_bits_probe.py: step 2's premise),
#       then the CUDA bits against .old
#   call 4 (~300 s, carry [".old"] after `git worktree add --detach .old 1e6af39`):
#       bash tools/h200_s19_validate.sh 4
#       the GPU tests of this session's changes (the group summed in the Gluon chunk-gradient
#       kernel, the launch cache), the host cost of a launch's pieces, then det fwd+bwd at
#       three shapes and the host time at B1 T1024, this tree against .old (1e6af39, before
#       the session)
#   call 2 (short, carry [".whl-base"]), then call 3 right after (carry [".whl", ".whl-fla"]):
#       bash tools/h200_s19_validate.sh 2 ; bash tools/h200_s19_validate.sh 3
#       det against FlashQLA at issue 19's six shapes in one run (with the kernels each
#       shape ran), the GPU tests of grouped value heads through the whole backward (bwd
#       alias, det KCP), host time against fla
#
TAG=s19
source "$(dirname "$0")/h200_lib.sh"

step1() {
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest -v -n 12 -m gpu -p no:cacheprovider \
    -p gdn_core.pytest_cuda_guard --import-mode=importlib -ra packages/gdn-core/tests \
    packages/gdn-det-train/tests packages/gdn-train/tests packages/gdn-det-train-kcp/tests \
    > "$LOG/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"; grep -E "^(FAILED|ERROR) |passed|failed" "$LOG/gpu_tests.log" | tail -25
  for o in unset 0 1; do
    if [[ $o == unset ]]; then unset GDN_CORE_DOC_ORDER; else export GDN_CORE_DOC_ORDER=$o; fi
    timeout 70 python3 benchmarks/profile_gdn.py --shapes 1x32768x16x8 --benchmark-lengths \
      --segments 4096 --iters 10 --rows 12 > "$LOG/profile_order_$o.txt" 2>&1
    echo "profile order=$o exit $?"
    grep -E "^===|_kernel " "$LOG/profile_order_$o.txt" | cut -c1-60,150-200
  done
  unset GDN_CORE_DOC_ORDER
  timeout 60 python3 benchmarks/wgmma_operand_bits_probe.py > "$LOG/wgmma_bits.txt" 2>&1
  echo "wgmma bits probe exit $?"; cat "$LOG/wgmma_bits.txt"
  local left=$(( ${CALL_LIMIT:-585} - ($(date +%s) - START) ))
  echo "bits with ${left} s left"
  mkdir -p "$LOG/bits"
  OUT=$LOG/bits STAGES=bits BITS_TIMEOUT=$(( left > 60 ? left - 50 : 10 )) \
    bash tools/h200_validate.sh
}

step4() {
  gpu_tests tests4.log 240 8 packages/gdn-core/tests/test_gluon_chunk_grads_gpu.py \
    packages/gdn-core/tests/test_launch_gpu.py
  timeout 60 python3 benchmarks/host_costs_probe.py 2>&1 | tee "$LOG/host_costs.txt"
  local root=$PWD new=$PYTHONPATH old shapes="B1,T32768,H16,HV32,D8;B1,T8192,H16;B1,T32768,H16,D8"
  old=$(ls -d "$root"/.old/packages/*/src | tr '\n' ':')
  for tree in new old; do
    if [[ $tree == old ]]; then export PYTHONPATH=${old%:}; cd "$root/.old"
    else export PYTHONPATH=$new; cd "$root"; fi
    timeout 150 python3 benchmarks/bench_gdn_train.py --arms det --warmup 5 --iters 20 \
      --shapes "$shapes" --acc-shapes none 2>&1 | grep -E "^\[.*(shape|det )" | sed "s/^/$tree /" \
      | tee -a "$LOG/e2e_ab.txt"
    timeout 60 python3 benchmarks/host_profile_gpu.py --iters 50 --repeats 3 --top 5 2>&1 \
      | head -7 | sed "s/^/$tree /" | tee -a "$LOG/host_ab.txt"
  done
  cd "$root"; export PYTHONPATH=$new
}

step2() { install_base; }

step3() {
  install_anchors || return 1
  local base=$PYTHONPATH
  PYTHONPATH="$base:/tmp/site:/tmp/site-base" timeout 360 python3 benchmarks/bench_gdn_train.py \
    --arms det --compare flashqla --warmup 5 --iters 20 --shapes "$SHAPES6" \
    --acc-shapes "B1,T512,H16" --warm-compile-jobs 6 --json "$LOG/qla.json" > "$LOG/qla.md" 2>&1
  echo "qla exit $?"; grep -A9 "Against the anchors" "$LOG/qla.md"
  grep -A10 "Which path each arm ran" "$LOG/qla.md" | cut -c1-240
  # the GPU tests of grouped value heads at K = V = 128 through the whole backward (the
  # group summed in the chunk-gradient kernel): aliases, KCP worlds and workspaces
  gpu_tests tests3.log 150 8 packages/gdn-core/tests/test_bwd_alias_gpu.py \
    packages/gdn-det-train-kcp/tests/test_det_kcp_gpu.py
  PYTHONPATH="$base:/tmp/site-fla:/tmp/site-base:/tmp/site" timeout ${HOST_TIMEOUT:-170} python3 \
    benchmarks/host_overhead_gpu.py --no-graph --iters 100 --repeats 3 > "$LOG/host_T1024_fla.txt" 2>&1
  echo "host exit $?"; cat "$LOG/host_T1024_fla.txt"
}

case "${1:-}" in
  1) step1 ;;
  4) step4 ;;
  2) step2 ;;
  3) step3 ;;
  *) echo "usage: bash tools/h200_s19_validate.sh 1|2|3|4"; exit 2 ;;
esac
pack "$1"
