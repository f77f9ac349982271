#!/usr/bin/env bash
# The H200 validation in two device calls: every package's `gpu` tests,
# the single-rank benchmark against fla (bf16, anchor shapes), and the
# simulated-world KCP benchmark at world 2/4/8. Logs and JSON land in $OUT.
#
#   device run (repo root, carry [".whl"]):  bash tools/h200_validate.sh
#   then:  STAGES="bench kcp" bash tools/h200_validate.sh
#
# .whl/ must hold fla-core's wheel (python3 -m pip download --no-deps
# fla-core==0.6.0 -d .whl). A device command may run 10 minutes, so make two
# calls: STAGES=tests (the gpu tests compile many kernels), then
# STAGES="bench kcp".
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-"tests"}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
SRC=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export PYTHONPATH="${SRC}/tmp/site"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='tree: %H %s' 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ $STAGES == *tests* ]]; then
  timeout 540 python3 -m pytest -q -m gpu --import-mode=importlib -p no:cacheprovider -ra \
    packages/gdn-core/tests packages/gdn-det-train/tests packages/gdn-train/tests \
    packages/gdn-det-train-kcp/tests packages/gdn-train-kcp/tests packages/kda-det-train/tests \
    > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"; tail -15 "$OUT/gpu_tests.log"
fi
if [[ $STAGES == *bench* ]]; then
  timeout 300 python3 benchmarks/bench_gdn_train.py --arms det,nondet --compare fla \
    --warmup 5 --iters 20 --json "$OUT/bench_gdn_train.json" > "$OUT/bench_gdn_train.md" 2>&1
  echo "bench exit $?"; grep -E '^\|' "$OUT/bench_gdn_train.md" | head -40
fi
if [[ $STAGES == *kcp* ]]; then
  for W in 2 4 8; do
    timeout 80 python3 benchmarks/bench_gdn_det_train_kcp.py --simulate --world "$W" \
      --boundary segment --seqlen 65536 --docs 16 --heads 16 --dim 128 --warmup 2 --iters 5 \
      --json "$OUT/kcp_w$W.json" > "$OUT/kcp_w$W.md" 2>&1
    echo "kcp world $W exit $?"; grep -iE 'slowest|ratio' "$OUT/kcp_w$W.md" | head -6
  done
fi
