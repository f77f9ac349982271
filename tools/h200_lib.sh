# Shared by the per-session device scripts (tools/h200_s<N>_validate.sh): source it with
# TAG set to the session's tag (s17, s18, ...). It sets OUT, LOG ($OUT/$TAG), PYTHONPATH
# (every package's src), START (for a call's time budget) and SHAPES6 (issue 19's six
# shapes), writes $LOG/env.txt, and defines:
#   e2e LABEL SHAPES   det fwd+bwd time and peak at SHAPES (e2e_<LABEL>.json, e2e.txt)
#   install_base       .whl-base into /tmp/site-base (FlashQLA's and tilelang's base wheels)
#   install_anchors    .whl and .whl-fla into /tmp/site and /tmp/site-fla (after install_base,
#                      in the same warm window: the machine keeps /tmp only while warm)
#   pack STEP          $LOG into $OUT/<TAG>_<STEP>.tgz (what comes back)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/$TAG"
_SRC=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export PYTHONPATH="${_SRC%:}"
LOG=$OUT/$TAG
{ nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1 2>/dev/null
} > "$LOG/env.txt" 2>&1
SHAPES6="B1,T32768,H16,HV32,D8;B1,T8192,H16;B1,T32768,H16;B4,T8192,H16;B1,T32768,H16,D8;B1,T65536,H16,D16"
START=$(date +%s)

e2e() {
  timeout "${E2E_TIMEOUT:-150}" python3 benchmarks/bench_gdn_train.py --arms det --warmup 5 \
    --iters 20 --shapes "$2" --acc-shapes none --json "$LOG/e2e_${1//[^A-Za-z0-9_]/_}.json" \
    2>&1 | grep -E "^\[.*(shape|det )" | sed "s/^/$1 /" | tee -a "$LOG/e2e.txt"
}

install_base() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-base .whl-base/*.whl
  echo "whl-base exit $?"
}

install_anchors() {
  [[ -d /tmp/site-base ]] || { echo "no /tmp/site-base: install_base first, right before"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fla .whl-fla/*.whl
  echo "anchors exit $?"
}

pack() {
  tar czf "$OUT/${TAG}_${1}.tgz" -C "$OUT" "$TAG" && rm -rf "${OUT:?}/$TAG"
}
