#!/usr/bin/env bash
# The H200 validation: every package's `gpu` tests, the single-rank benchmark
# against fla (bf16, anchor shapes) and the simulated-world KCP benchmark.
# Logs and JSON land in $OUT.
#
#   device run (repo root, carry [".whl"]):  bash tools/h200_validate.sh
#
# .whl/ must hold fla-core's wheel (python3 -m pip download --no-deps
# fla-core==0.6.0 -d .whl). STAGES picks the parts ("tests bench kcp");
# TEST_TIMEOUT, BENCH_TIMEOUT (seconds) and KCP_WORLDS ("2 4 8") bound them.
#
# A device command may run 10 minutes. The gpu tests are compile-bound (one
# Triton compile per kernel variant): they run under pytest-xdist. With two
# GPUs (nvidia-h200-x2) the tests and the simulated KCP benchmark use GPU 1
# and cores 4+, while the fla comparison runs alone on GPU 0 and cores 0-3 —
# one call does everything. With one GPU the stages run one after another
# (then give STAGES=tests and STAGES="bench kcp" to two calls).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-"tests bench kcp"}
TEST_TIMEOUT=${TEST_TIMEOUT:-400}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-420}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
SRC=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export PYTHONPATH="${SRC}/tmp/site"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
NCPU=$(nproc)
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "gpus $NGPU cpus $NCPU"
  git log -1 --format='tree: %H %s' 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ $NGPU -ge 2 ]]; then
  BENCH_ENV=(env CUDA_VISIBLE_DEVICES=0 taskset -c 0-3)
  SIDE_ENV=(env CUDA_VISIBLE_DEVICES=1 taskset -c 4-$((NCPU - 1)))
  WORKERS=$(( (NCPU - 4) / 2 ))
else
  BENCH_ENV=(env)
  SIDE_ENV=(env)
  WORKERS=$(( NCPU / 2 ))
fi

run_tests() {
  timeout "$TEST_TIMEOUT" "${SIDE_ENV[@]}" python3 -m pytest -q -m gpu -n "$WORKERS" \
    --import-mode=importlib -p no:cacheprovider -ra \
    packages/gdn-core/tests packages/gdn-det-train/tests packages/gdn-train/tests \
    packages/gdn-det-train-kcp/tests packages/gdn-train-kcp/tests packages/kda-det-train/tests \
    2>&1 | grep -v '^DEBUG\|^INFO' > "$OUT/gpu_tests.log"
  echo "gpu tests exit ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.log"
}

run_kcp() {
  for W in ${KCP_WORLDS:-2 4 8}; do
    timeout 80 "${SIDE_ENV[@]}" python3 benchmarks/bench_gdn_det_train_kcp.py --simulate \
      --world "$W" --boundary segment --seqlen 65536 --docs 16 --heads 16 --dim 128 \
      --warmup 2 --iters 5 --json "$OUT/kcp_w$W.json" > "$OUT/kcp_w$W.md" 2>&1
    echo "kcp world $W exit $?"
  done
}

run_bench() {
  timeout "$BENCH_TIMEOUT" "${BENCH_ENV[@]}" python3 benchmarks/bench_gdn_train.py \
    --arms det,nondet --compare fla --warmup 5 --iters 20 \
    --json "$OUT/bench_gdn_train.json" > "$OUT/bench_gdn_train.md" 2>&1
  echo "bench exit $?"
}

side() {
  if [[ $STAGES == *tests* ]]; then run_tests; fi
  if [[ $STAGES == *kcp* ]]; then run_kcp; fi
}

if [[ $NGPU -ge 2 ]]; then
  side > "$OUT/side.txt" 2>&1 &
  if [[ $STAGES == *bench* ]]; then run_bench; fi
  wait
  cat "$OUT/side.txt"
else
  side
  if [[ $STAGES == *bench* ]]; then run_bench; fi
fi
[[ -f $OUT/gpu_tests.log ]] && tail -8 "$OUT/gpu_tests.log"
[[ -f $OUT/bench_gdn_train.md ]] && grep -E '^\|' "$OUT/bench_gdn_train.md" | head -40
for W in 2 4 8; do [[ -f $OUT/kcp_w$W.md ]] && grep -A5 -i slowest "$OUT/kcp_w$W.md"; done
exit 0
