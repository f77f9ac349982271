#!/usr/bin/env bash
# Branch s12-validate (main + layerspeed + gluon-output + gluon-chunkgrads): everything
# session 11 built without a GPU, checked and timed on the H200 in two device calls.
#
#   call 1 (carry [".whl-fla"], ~420 s):  bash tools/h200_s12_validate.sh 1
#       the GPU tests of the changed Triton kernels and of the two Gluon kernels, the
#       Gluon probes, the forward kernels' launch variants
#   call 2 (carry [".whl-fla"], ~450 s):  bash tools/h200_s12_validate.sh 2
#       conv and layer against fla (STAGES=layer), the KCP worlds with and without the
#       busy spin (STAGES=kcp)
#   call 3 (~300 s):  bash tools/h200_s12_validate.sh 3
#       end to end with the Gluon kernels switched in (GDN_CORE_GLUON=all) against
#       without: bench_gdn_train.py --arms det on four shapes, and the kernel profile
#
# Everything lands in $OUT/s12_<step>.tgz (logs inside). Merge what passes and is faster.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/s12"
SRC=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export PYTHONPATH="${SRC%:}"
LOG=$OUT/s12
{ nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1 2>/dev/null; } > "$LOG/env.txt" 2>&1

step1() {
  timeout 240 python3 -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider \
    --import-mode=importlib -ra packages/gdn-core/tests/test_conv1d.py \
    packages/gdn-core/tests/test_conv1d_triton.py packages/gdn-core/tests/test_layer_norm.py \
    packages/gdn-core/tests/test_ops_forward.py packages/gdn-core/tests/test_ops_backward.py \
    packages/gdn-core/tests/test_gluon_output.py packages/gdn-core/tests/test_gluon_output_gpu.py \
    packages/gdn-core/tests/test_gluon_chunk_grads.py \
    packages/gdn-core/tests/test_gluon_chunk_grads_gpu.py \
    packages/gdn-core/tests/test_gluon_routing.py > "$LOG/tests.log" 2>&1
  echo "tests exit $?"; tail -15 "$LOG/tests.log" | grep -E "passed|failed|FAILED|ERROR"
  timeout 60 python3 benchmarks/gluon_output_probe.py > "$LOG/gluon_output_probe.txt" 2>&1
  echo "gluon output probe exit $?"; tail -8 "$LOG/gluon_output_probe.txt"
  timeout 90 python3 benchmarks/gluon_chunk_grads_probe.py > "$LOG/gluon_grads_probe.txt" 2>&1
  echo "gluon chunk-grads probe exit $?"; tail -12 "$LOG/gluon_grads_probe.txt"
  timeout 200 python3 benchmarks/kernel_variants.py --kernels output,wy,dv_local --docs 8 \
    > "$LOG/variants.txt" 2>&1
  echo "variants exit $?"; grep -E "pinned|x\)" "$LOG/variants.txt" | head -30
}

step2() {
  OUT=$LOG STAGES=layer LAYER_TIMEOUT=${LAYER_TIMEOUT:-300} bash tools/h200_validate.sh
  OUT=$LOG STAGES=kcp KCP_WORLDS="4 8" KCP_TIMEOUT=70 bash tools/h200_validate.sh
  OUT=$LOG/busy STAGES=kcp KCP_WORLDS="4 8" KCP_TIMEOUT=70 KCP_EXTRA="--busy-us 3000" \
    bash tools/h200_validate.sh
}

step3() {
  local shapes="B1,T8192,H16;B1,T32768,H16;B4,T8192,H16;B1,T32768,H16,D8"
  for mode in triton gluon; do
    local env=()
    [[ $mode == gluon ]] && env=(GDN_CORE_GLUON=all)
    env ${env[@]+"${env[@]}"} timeout 130 python3 benchmarks/bench_gdn_train.py --arms det --warmup 5 \
      --iters 20 --shapes "$shapes" --acc-shapes "B1,T512,H16" --json "$LOG/e2e_$mode.json" \
      > "$LOG/e2e_$mode.md" 2>&1
    echo "e2e $mode exit $?"
    awk '/^## /{keep = ($0 ~ /Time and memory/)} keep && /^\|/' "$LOG/e2e_$mode.md" | cut -c1-160
  done
  (cd benchmarks && GDN_CORE_GLUON=all timeout 60 python3 profile_gdn.py --shapes 1x32768x16x8 \
    --segments 4096 --iters 10 > "$LOG/profile_gluon.txt" 2>&1)
  echo "profile exit $?"; grep -E "===|kernel" "$LOG/profile_gluon.txt" | cut -c1-60,150-200 | head -14
}

step4() {  # the GPU-marked tests of the changed kernels; installs .whl-base for step 5
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-base .whl-base/*.whl
  echo "whl-base exit $?"
  timeout 300 python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider -p gdn_core.pytest_cuda_guard \
    --import-mode=importlib -ra packages/gdn-core/tests packages/gdn-det-train/tests \
    packages/gdn-train/tests > "$LOG/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"; grep -E "passed|failed|FAILED|ERROR" "$LOG/gpu_tests.log" | tail -25
}

step5() {  # det (Gluon kernels switched in) against FlashQLA on issue 19's six shapes
  [[ -d /tmp/site-base ]] || { echo "no /tmp/site-base: run step 4 first"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site-base"
  local shapes="B1,T8192,H16;B1,T32768,H16;B4,T8192,H16;B1,T32768,H16,D8;B1,T65536,H16,D16;B1,T32768,H16,HV32,D8"
  GDN_CORE_GLUON=all timeout 520 python3 benchmarks/bench_gdn_train.py --arms det --compare flashqla \
    --warmup 5 --iters 20 --shapes "$shapes" --acc-shapes "B1,T512,H16" --json "$LOG/qla.json" \
    > "$LOG/qla.md" 2>&1
  echo "qla exit $?"
  awk '/^## /{keep = ($0 ~ /Time and memory/)} keep && /^\|/' "$LOG/qla.md" | cut -c1-200
}

case "${1:-}" in
  1) step1 ;;
  2) step2 ;;
  3) step3 ;;
  4) step4 ;;
  5) step5 ;;
  *) echo "usage: bash tools/h200_s12_validate.sh 1|2|3|4|5"; exit 2 ;;
esac
tar czf "$OUT/s12_${1}.tgz" -C "$OUT" s12 && rm -rf "$OUT/s12"
