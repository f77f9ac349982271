#!/usr/bin/env bash
# Session-3 final H200 call (one budgeted x2 call). Logs in $OUT.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
S=$(ls -d "$PWD"/packages/*/src | tr '\n' ':'); export PYTHONPATH="${S}/tmp/site"
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/env.txt" 2>&1
# an overlay of gdn_core with the five kernel modules (and ops/__init__) of e53fc76
O=/tmp/orig; mkdir -p $O; cp -r packages/gdn-core/src/gdn_core $O/
for m in wy wy_bwd chunk_state chunk_state_bwd dqkwg; do cp scratch/orig_$m.py $O/gdn_core/ops/$m.py; done
cp scratch/orig_ops_init.py $O/gdn_core/ops/__init__.py
(
  CUDA_VISIBLE_DEVICES=1 timeout 90 taskset -c 24-31 python3 benchmarks/profile_gdn.py \
    --shapes 1x8192x16x1,4x8192x16x1,1x32768x16x1,1x65536x16x16 --segments 1024,0 --iters 10 --rows 12 \
    > "$OUT/profile.txt" 2>&1; echo "profile exit $?"
  CUDA_VISIBLE_DEVICES=1 timeout 215 taskset -c 24-31 python3 benchmarks/bench_gdn_train.py \
    --arms det,nondet,det-plain --compare fla --warmup 3 --iters 10 \
    --shapes "B1,T32768,H16;B1,T8192,H16" --acc-shapes "B1,T512,H16" \
    --json "$OUT/bench.json" > "$OUT/bench.md" 2>&1; echo "bench exit $?"
) &
T=packages/gdn-core/tests/test_ops_backward.py
K48="test_full_backward and K48"
CUDA_VISIBLE_DEVICES=0 CUDA_LAUNCH_BLOCKING=1 timeout 60 taskset -c 0-11 python3 -m pytest -q -x -p no:cacheprovider \
  --import-mode=importlib $T -k "$K48" > "$OUT/k48_head.log" 2>&1 &
PID_H=$!
CUDA_VISIBLE_DEVICES=0 CUDA_LAUNCH_BLOCKING=1 PYTHONPATH="$O:${S}/tmp/site" timeout 60 taskset -c 12-23 \
  python3 -m pytest -q -x -p no:cacheprovider --import-mode=importlib $T -k "$K48" > "$OUT/k48_orig.log" 2>&1
wait $PID_H
echo "k48 head: $(tail -1 "$OUT/k48_head.log")"; echo "k48 orig: $(tail -1 "$OUT/k48_orig.log")"
CUDA_VISIBLE_DEVICES=0 timeout 175 taskset -c 0-23 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider \
  --import-mode=importlib -ra packages/gdn-core/tests packages/gdn-det-train/tests packages/gdn-train/tests \
  packages/gdn-det-train-kcp/tests packages/gdn-train-kcp/tests packages/kda-det-train/tests \
  2>&1 | grep -v '^DEBUG\|^INFO' > "$OUT/gpu_tests.log"
echo "gpu tests exit ${PIPESTATUS[0]}"; tail -6 "$OUT/gpu_tests.log"
wait
grep -E "===" "$OUT/profile.txt"; grep -E '^\|' "$OUT/bench.md" | head -12
