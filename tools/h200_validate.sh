#!/usr/bin/env bash
# The H200 validation run: the `gpu` tests of every package and the
# single-rank benchmark against fla, on the device machine.
# Usage (device tool, repo root): bash tools/h200_validate.sh [BENCH_ARGS...]
# Needs fla-core's wheel in .whl/ (carried); writes logs and JSON to $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
SRC=$(ls -d packages/*/src | tr '\n' ':')
export PYTHONPATH="${SRC}/tmp/site"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout 300 python3 -m pytest -q -m gpu -x --import-mode=importlib -p no:cacheprovider \
  packages/gdn-core/tests packages/gdn-det-train/tests packages/gdn-train/tests \
  packages/gdn-det-train-kcp/tests packages/gdn-train-kcp/tests packages/kda-det-train/tests \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -40
timeout 240 python3 benchmarks/bench_gdn_train.py --arms det,nondet --compare fla \
  --json "$OUT/bench_gdn_train.json" "$@" 2>&1 | tee "$OUT/bench_gdn_train.md" | tail -40
