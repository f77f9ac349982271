#!/usr/bin/env bash
# Session 26's device calls. Name kind "nvidia-h200" (an H100 may serve: ratios within a call).
#
#   call 1 (~450 s, carry [".old-src.tgz"]: `git archive <old> packages | gzip`):
#       CALL_LIMIT=560 bash tools/h200_s26_validate.sh 1
#       the cheaper dg sums in the Gluon chunk gradients (crossing sums without the shift,
#       one masked sum for the prefix/suffix terms, the crossing sums overlapping phase A's
#       and D's first products): the Gluon chunk-gradient, pipelined, fused_bwd and alias
#       GPU tests (the new strong-decay dg test included, its figures printed), then the
#       kernel probes and det fwd+bwd, old (the carried tree) against new, same machine
#   call 2 (~450 s): CALL_LIMIT=500 bash tools/h200_s26_validate.sh 2
#       every gpu-marked test of the four GDN packages, the host profile at B1 T1024, the
#       CUDA bits check in what is left
#   call 5 (~250 s, carry [".whl-fla"]): CALL_LIMIT=520 bash tools/h200_s26_validate.sh 5
#       the tests call 2 lost to out-of-memory, then the host against fla (ran without
#       --fla-force: fla's arm refused; call 6 repeated it by hand with it, see the results)
#   call 7 (~30 s): CALL_LIMIT=220 bash tools/h200_s26_validate.sh 7
#       Nsight Compute on the one-tile and the persistent chunk-gradient kernels
TAG=s26
source "$(dirname "$0")/h200_lib.sh"
NEW_PATH=$PYTHONPATH

old_tree() {
  mkdir -p /tmp/old && tar xzf .old-src.tgz -C /tmp/old || return 1
  OLD_PATH=$(ls -d /tmp/old/packages/*/src | tr '\n' ':'); OLD_PATH=${OLD_PATH%:}
}

step1() {
  old_tree || { echo "no .old-src.tgz"; return 1; }
  gpu_tests grads_tests.log 240 6 packages/gdn-core/tests/test_gluon_chunk_grads_gpu.py \
    packages/gdn-core/tests/test_gluon_chunk_grads_pipelined_gpu.py \
    packages/gdn-core/tests/test_gluon_fused_bwd_gpu.py packages/gdn-core/tests/test_bwd_alias_gpu.py
  timeout 60 python3 -m pytest -q -s -m gpu -p no:cacheprovider --import-mode=importlib \
    -k strong_decay packages/gdn-core/tests/test_gluon_chunk_grads_gpu.py 2>&1 | grep -E "strong|passed|failed"
  PYTHONPATH=$OLD_PATH:$NEW_PATH timeout 60 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
    --import-mode=importlib -k strong_decay packages/gdn-core/tests/test_gluon_chunk_grads_gpu.py \
    2>&1 | grep -E "strong|passed|failed" | sed "s/^/old kernel: /"
  for arm in new old new; do
    if [[ $arm == old ]]; then export PYTHONPATH=$OLD_PATH; else export PYTHONPATH=$NEW_PATH; fi
    timeout 60 python3 benchmarks/gluon_chunk_grads_probe.py --docs 1,8 > "$LOG/probe_$arm.txt" 2>&1
    echo "grads probe $arm exit $?"; tail -6 "$LOG/probe_$arm.txt"
  done
  for arm in new old; do
    if [[ $arm == old ]]; then export PYTHONPATH=$OLD_PATH; else export PYTHONPATH=$NEW_PATH; fi
    timeout 80 python3 benchmarks/gluon_fused_bwd_probe.py --shapes 32768:8 > "$LOG/fprobe_$arm.txt" 2>&1
    echo "fused probe $arm exit $?"; tail -4 "$LOG/fprobe_$arm.txt"
  done
  local S="B4,T8192,H16;B1,T32768,H16,D8;B1,T32768,H16,HV32,D8"
  for arm in new old new; do
    (( $(date +%s) - START < ${CALL_LIMIT:-560} - 75 )) || { echo "no time for e2e $arm"; break; }
    if [[ $arm == old ]]; then export PYTHONPATH=$OLD_PATH; else export PYTHONPATH=$NEW_PATH; fi
    E2E_TIMEOUT=70 e2e "$arm" "$S"
  done
  export PYTHONPATH=$NEW_PATH
}

step2() {
  PROFILE=0 SUITE_THEN=step2_probes suite_step
}

step2_probes() {
  host_profile
  timeout 60 python3 benchmarks/gluon_chunk_grads_pipelined_probe.py > "$LOG/pipelined.txt" 2>&1
  echo "pipelined probe exit $?"; tail -8 "$LOG/pipelined.txt"
}

# the host loop at B1 T1024 H16 bf16, arm by arm (autograd with and without its device thread,
# the split API, the floors), and its cProfile (host_profile_gpu.py)
host_profile() {
  timeout 120 python3 benchmarks/host_profile_gpu.py --iters 50 --repeats 5 --top 25 \
    > "$LOG/host_profile_T1024.txt" 2>&1
  echo "host profile exit $?"; grep -E "host .* ms/step|Python calls" "$LOG/host_profile_T1024.txt"
}
# call 5: the tests call 2 lost to out-of-memory (12 workers on an 80 GB H100), listed in
# .s26_rerun.txt (one pytest id a line, made from call 2's log; not kept), on 4 workers; then, with
# .whl-fla carried, the host at B1 T1024 against fla's Triton kernels with every arm's
# backward on the calling thread and with autograd's device thread
step5() {
  gpu_tests rerun.log 260 4 $(cat .s26_rerun.txt)
  [[ -d .whl-fla ]] || return 0  # carried: the host time against fla's Triton kernels
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fla .whl-fla/*.whl
  for mode in --backward-on-caller ""; do
    PYTHONPATH="$PYTHONPATH:/tmp/site-fla" timeout 110 python3 benchmarks/host_overhead_gpu.py \
      --no-graph --iters 100 --repeats 3 $mode > "$LOG/host_T1024_fla${mode}.txt" 2>&1
    echo "host $mode exit $?"; cat "$LOG/host_T1024_fla${mode}.txt"
  done
}
# call 7: Nsight Compute on one launch each of the one-tile and the persistent chunk-gradient
# kernels (why prefetching the next tile loses), the details page as CSV
step7() {
  ncu_details 170 cg -k regex:"chunk_grads_bwd_gluon" python3 tools/ncu_chunk_grads_once.py
}

case "${1:-}" in
  1) step1 ;;
  2) step2 ;;
  5) step5 ;;
  7) step7 ;;
  *) echo "usage: bash tools/h200_s26_validate.sh 1|2|5|7"; exit 2 ;;
esac
pack "$1"
