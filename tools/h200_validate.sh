#!/usr/bin/env bash
# The H200 validation: every package's `gpu` tests, the single-rank benchmark
# against fla (bf16, anchor shapes) and the simulated-world KCP benchmark.
# Logs and JSON land in $OUT, packed into $OUT/all_<STAGES>.tgz at the end (one archive per invocation).
#
#   device run (repo root, carry [".whl"]):  bash tools/h200_validate.sh
#
# .whl/ must hold fla-core's wheel (python3 -m pip download --no-deps
# fla-core==0.6.0 -d .whl), or all the anchors' wheels (../shared/tools/fetch-anchor-wheels.sh:
# fla-core, flash-qla, tilelang); they go to /tmp/site. FlashQLA's dependencies (.whl-base/, too
# large to carry with .whl) are installed by an earlier call of their own into /tmp/site-base,
# which this script puts on PYTHONPATH when it exists and never reinstalls (benchmarks/README.md).
# BENCH_COMPARE picks the benchmark's anchors (default "fla"; e.g. "fla flashqla flashqla-exact";
# each runs in its own process; BENCH_TIMEOUT must cover TileLang's first compiles, 10-35 s a kernel).
# STAGES picks the parts ("sanitize tests shapes bench
# variants kcp nccl bits hosttime", "split"); "variants" times benchmarks/kernel_variants.py;
# "bits" compares the deterministic calls' bits of a carried .old/ checkout (git worktree
# add .old <commit>, carry [".old"]) with this tree's (tools/bits_snapshot.py --backends cuda);
# "hosttime" runs benchmarks/host_overhead_gpu.py (HOST_SHAPE, HOST_EXTRA);
# "layer" runs bench_conv.py and bench_layer.py against fla (carry [".whl-fla"]; LAYER_SHAPES,
# LAYER_EXTRA=--profile, LAYER_TIMEOUT: fla autotunes ~160 s at its first shape, cold);
# "sanitize" runs compute-sanitizer on the two shapes that hit an illegal address
# on 2026-11-30 (it names the faulting kernel);
# TEST_TIMEOUT, BENCH_TIMEOUT (seconds) and KCP_WORLDS ("2 4 8") bound them; KCP_EXTRA goes to
# the KCP benchmark (e.g. "--busy-us 3000", or "--segment-size 1024").
#
# A device command may run 10 minutes. The gpu tests are compile-bound (one
# Triton compile per kernel variant, ~250 s): they run under pytest-xdist, with
# gdn_core.pytest_cuda_guard so that a test that breaks its worker's CUDA
# context (an illegal address) does not fail every later test of that worker.
# The benchmark is two halves (fixed-length shapes; packed documents), each
# ~250 s because fla autotunes per shape class; on nvidia-h200-x2 they run at
# once, one per GPU. Stages never overlap, so no timed run shares a GPU.
#   call 1: STAGES="tests bench"   (x2: ~520 s)      call 2: STAGES="kcp nccl"
# STAGES=shapes runs gdn-core's interpreter suites (K=48, V=16, grouped heads,
# fp16, ...) on the GPU: they take CUDA when present; the 2026-11-30 run found
# an illegal address there that the gpu-marked shapes never hit.
# STAGES=split (x2, ~450 s): GPU 0 runs the gpu tests then the packed-document
# half; GPU 1 meanwhile the scripts in KERNEL_TIMINGS, the profile and the
# fixed-shape half (timed runs on their own GPU and cores, never beside each other);
# KERNEL_TIMEOUT bounds each of those scripts, SPLIT_PROFILE=0 leaves the profile out
# (PROFILE_SHAPES, PROFILE_SEGMENTS, PROFILE_TIMEOUT shape it), SPLIT_DEMO=0 the NCCL demo.
# STAGES=pair (x2, ~290 s): GPU 0 the fixed-shape half then the simulated KCP worlds
# (KCP_TIMEOUT each); GPU 1 the packed-document half then profile_gdn.py over
# PROFILE_SHAPES x PROFILE_SEGMENTS. BENCH_ARMS picks the benchmark's arms.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-"tests bench"}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-280}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
else
  echo "no .whl/*.whl here: using /tmp/site as it is"
fi
SRC=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export PYTHONPATH="${SRC}/tmp/site"
if [[ -d /tmp/site-base ]]; then export PYTHONPATH="$PYTHONPATH:/tmp/site-base"; fi
BENCH_COMPARE=${BENCH_COMPARE:-fla}
COMPARE_ARGS=()
for c in $BENCH_COMPARE; do COMPARE_ARGS+=(--compare "$c"); done
if [[ $BENCH_COMPARE == *flashqla* || $BENCH_COMPARE == *fla-dispatch* || $BENCH_COMPARE == *fla-tilelang* ]] \
   && [[ ! -d /tmp/site-base ]]; then
  echo "warning: BENCH_COMPARE=\"$BENCH_COMPARE\" but no /tmp/site-base: FlashQLA's dependencies" \
    "(.whl-base) were not installed by an earlier call; its arms will be skipped or fail to load"
fi
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
NCPU=$(nproc)
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "
import importlib.metadata as m
for d in ('fla-core', 'flash-qla', 'tilelang', 'apache-tvm-ffi', 'torch-c-dlpack-ext', 'z3-solver'):
    try: print(d, m.version(d))
    except m.PackageNotFoundError: print(d, 'absent')"
  echo "PYTHONPATH=$PYTHONPATH"
  echo "gpus $NGPU cpus $NCPU"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# Two benchmark halves: fixed-length shapes, and packed documents (fla autotunes
# once per shape class, ~100 s each; the accuracy case follows its class).
HALF_A="B1,T8192,H16;B1,T32768,H16;B4,T8192,H16"
ACC_A="B1,T512,H16;B1,T5000,H16"  # T5000: two segments of the default 4096
HALF_B="B1,T32768,H16,D8;B1,T65536,H16,D16;B1,T32768,H16,HV32,D8"
ACC_B="B1,T512,H16,HV32,D3"
LAST=$((NCPU - 1)); MID=$((NCPU / 2))

run_tests() {
  CUDA_VISIBLE_DEVICES=${TEST_GPU:-$(seq -s, 0 $((NGPU - 1)))} timeout "$TEST_TIMEOUT" \
    taskset -c "${TEST_CORES:-0-$LAST}" \
    python3 -m pytest -q -m gpu -n "$(( NCPU / 2 ))" --max-worker-restart 16 \
    -p gdn_core.pytest_cuda_guard --import-mode=importlib -p no:cacheprovider -ra \
    packages/gdn-core/tests packages/gdn-det-train/tests packages/gdn-train/tests \
    packages/gdn-det-train-kcp/tests packages/gdn-train-kcp/tests packages/kda-det-train/tests \
    2>&1 | grep -v '^DEBUG\|^INFO' > "$OUT/gpu_tests.log"
  echo "gpu tests exit ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.log"
  tail -8 "$OUT/gpu_tests.log"
}

run_cpu_shapes() {  # gdn-core's interpreter-suite shapes (odd K/V, grouped heads, fp16) on the GPU
  CUDA_VISIBLE_DEVICES=${TEST_GPU:-0} timeout "$TEST_TIMEOUT" python3 -m pytest -q -n "$(( NCPU / 2 ))" \
    --max-worker-restart 16 -p gdn_core.pytest_cuda_guard --import-mode=importlib \
    -p no:cacheprovider -ra packages/gdn-core/tests/test_ops_forward.py \
    packages/gdn-core/tests/test_ops_backward.py packages/gdn-core/tests/test_segment.py \
    2>&1 | grep -v '^DEBUG\|^INFO' > "$OUT/cpu_shapes_on_gpu.log"
  echo "interpreter-suite shapes on the GPU exit ${PIPESTATUS[0]}"; tail -6 "$OUT/cpu_shapes_on_gpu.log"
}

run_sanitize() {  # the two shapes that hit an illegal address on 2026-11-30, under compute-sanitizer
  local T=packages/gdn-core/tests/test_ops_backward.py i=0
  for k in "test_full_backward_gpu and group4 and bf16" "test_full_backward and K48"; do
    local log="$OUT/sanitize_${k//[^A-Za-z0-9]/_}.log" gpu=$(( i % NGPU )); i=$((i + 1))
    ( CUDA_VISIBLE_DEVICES=${TEST_GPU:-$gpu} timeout "${SANITIZE_TIMEOUT:-240}" \
        compute-sanitizer --tool memcheck --print-limit 8 \
        python3 -m pytest -q -x -p no:cacheprovider --import-mode=importlib $T -k "$k" > "$log" 2>&1
      echo "sanitize [$k] exit $?"
      grep -E "Invalid|at 0x|in _|ERROR SUMMARY|passed|failed" "$log" | head -12 ) &
  done
  wait
}

bench_half() {  # name shapes acc gpu cores
  timeout "$BENCH_TIMEOUT" env CUDA_VISIBLE_DEVICES="$4" taskset -c "$5" \
    python3 benchmarks/bench_gdn_train.py --arms "${BENCH_ARMS:-det,nondet,det-plain}" ${COMPARE_ARGS[@]+"${COMPARE_ARGS[@]}"} \
    --warmup 5 --iters 20 --shapes "$2" --acc-shapes "$3" ${BENCH_EXTRA:-} \
    --json "$OUT/bench_gdn_train_$1.json" > "$OUT/bench_gdn_train_$1.md" 2>&1
  echo "bench $1 exit $?"
}

show_bench() {  # the two halves' time, anchor-ratio and path tables (SHOW_TABLES; all in the .md)
  for h in a b; do
    grep -E '^- anchors installed' "$OUT/bench_gdn_train_$h.md" | head -1
    awk -v want="${SHOW_TABLES:-Time and memory|Against the anchors|Which path}" \
      '/^## /{keep = ($0 ~ want)} keep && /^\|/' "$OUT/bench_gdn_train_$h.md" \
      | cut -c1-"${SHOW_WIDTH:-200}" | head -"${SHOW_ROWS:-60}"
  done
}

run_profile() {  # gpu cores default-shapes default-segments: profile_gdn.py (PROFILE_* override)
  CUDA_VISIBLE_DEVICES=$1 timeout "${PROFILE_TIMEOUT:-120}" taskset -c "$2" \
    python3 benchmarks/profile_gdn.py --shapes "${PROFILE_SHAPES:-$3}" \
    --segments "${PROFILE_SEGMENTS:-$4}" --iters 10 --rows 12 > "$OUT/profile.txt" 2>&1
  echo "profile exit $?"
}

run_bench() {
  if [[ $NGPU -ge 2 ]]; then  # each half alone on its GPU and cores
    bench_half a "$HALF_A" "$ACC_A" 0 "0-$((MID - 1))" &
    bench_half b "$HALF_B" "$ACC_B" 1 "$MID-$LAST" &
    wait
  else
    bench_half a "$HALF_A" "$ACC_A" 0 "0-$LAST"
    bench_half b "$HALF_B" "$ACC_B" 0 "0-$LAST"
  fi
  show_bench
}

run_kcp() {
  for W in ${KCP_WORLDS:-2 4 8}; do
    timeout "${KCP_TIMEOUT:-80}" python3 benchmarks/bench_gdn_det_train_kcp.py --simulate \
      --world "$W" --boundary segment --seqlen 65536 --docs 16 --heads 16 --dim 128 \
      --warmup 2 --iters 5 ${KCP_EXTRA:-} --json "$OUT/kcp_w$W.json" > "$OUT/kcp_w$W.md" 2>&1
    echo "kcp world $W exit $?"; grep -A5 -i slowest "$OUT/kcp_w$W.md"
  done
}

run_nccl() {  # issue 6: real ranks over NCCL, one per GPU (needs >= 2 GPUs); the demo
  if [[ $NGPU -lt 2 ]]; then echo "nccl: needs 2 GPUs, found $NGPU"; return; fi
  timeout "$TEST_TIMEOUT" python3 -m pytest -q -m gpu -p no:cacheprovider \
    --import-mode=importlib -ra packages/gdn-det-train-kcp/tests/test_det_kcp_nccl.py \
    packages/gdn-train-kcp/tests/test_kcp_nccl.py > "$OUT/nccl_tests.log" 2>&1
  echo "nccl tests exit $?"; tail -5 "$OUT/nccl_tests.log"
  timeout 300 python3 -m gdn_det_train_kcp.demo --device cuda > "$OUT/demo_nccl.log" 2>&1
  echo "demo over NCCL exit $?"; tail -4 "$OUT/demo_nccl.log"
  timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_gdn_det_train_kcp.py --world "$NGPU" \
    --boundary segment --seqlen 131072 --docs 32 --heads 16 --dim 128 --warmup 3 --iters 10 \
    --json "$OUT/kcp_nccl_w$NGPU.json" > "$OUT/kcp_nccl_w$NGPU.md" 2>&1
  echo "kcp nccl world $NGPU exit $?"; grep -A5 -i slowest "$OUT/kcp_nccl_w$NGPU.md"
}

run_variants() {  # launch-config variants of the state / WY-backward kernels, timed alone
  CUDA_VISIBLE_DEVICES=${TEST_GPU:-0} timeout "${VARIANTS_TIMEOUT:-300}" \
    python3 benchmarks/kernel_variants.py > "$OUT/kernel_variants.txt" 2>&1
  echo "kernel variants exit $?"; grep -E "pinned|x\)" "$OUT/kernel_variants.txt" | head -60
}

run_split() {  # two GPUs, one budgeted call: GPU 0 tests then half b; GPU 1 kernel timings, profile, half a
  local C=$((NCPU * 3 / 4))
  (
    for f in ${KERNEL_TIMINGS:-}; do
      CUDA_VISIBLE_DEVICES=1 timeout "${KERNEL_TIMEOUT:-90}" taskset -c "$C-$LAST" python3 "$f" \
        > "$OUT/$(basename "$f" .py).txt" 2>&1
      echo "timing $f exit $?"
    done
    if [[ ${SPLIT_PROFILE:-1} == 1 ]]; then
      run_profile 1 "$C-$LAST" 1x8192x16x1,4x8192x16x1,1x32768x16x1,1x65536x16x16 1024,0
    fi
    bench_half a "$HALF_A" "$ACC_A" 1 "$C-$LAST"
  ) &
  TEST_GPU=0 TEST_CORES="0-$((C - 1))" run_tests  # (so the NCCL worlds skip: GPU 1 is timing)
  bench_half b "$HALF_B" "$ACC_B" 0 "0-$((C - 1))"
  wait
  show_bench
  if [[ $NGPU -ge 2 && ${SPLIT_DEMO:-1} == 1 ]]; then  # the README's demo, one rank per GPU (NCCL)
    timeout 150 python3 -m gdn_det_train_kcp.demo --device cuda > "$OUT/demo_nccl.log" 2>&1
    echo "demo over NCCL exit $?"; tail -4 "$OUT/demo_nccl.log"
  fi
}

run_pair() {  # two GPUs, one budgeted call: GPU 0 half a then the KCP worlds; GPU 1 half b then the profile
  local C=$MID
  (
    bench_half b "$HALF_B" "$ACC_B" 1 "$C-$LAST"
    run_profile 1 "$C-$LAST" 1x32768x16x1,1x65536x16x16 1024,4096,0
  ) &
  bench_half a "$HALF_A" "$ACC_A" 0 "0-$((C - 1))"
  CUDA_VISIBLE_DEVICES=0 KCP_TIMEOUT=${KCP_TIMEOUT:-70} run_kcp
  wait
  show_bench
}

# One stage after another: nothing shares a GPU with a timed run.
run_bits() {  # issue 18: the deterministic calls' bits before (.old: a checkout of the old code,
  # carried) and after, on the GPU (tools/bits_snapshot.py --backends cuda)
  local old
  old=$(ls -d "$PWD"/.old/packages/*/src 2>/dev/null | tr '\n' ':')
  if [[ -z $old ]]; then echo "bits: no .old/ checkout carried"; return; fi
  { PYTHONPATH="${old}/tmp/site" timeout "${BITS_TIMEOUT:-240}" \
      python3 tools/bits_snapshot.py save /tmp/bits_old.pt --backends cuda \
    && timeout "${BITS_TIMEOUT:-240}" python3 tools/bits_snapshot.py check /tmp/bits_old.pt \
      --backends cuda; } > "$OUT/bits.log" 2>&1
  echo "bits exit $?"; tail -4 "$OUT/bits.log"
}

run_hosttime() {  # issue 18: host time of back-to-back fwd+bwd calls (HOST_SHAPE, HOST_EXTRA)
  timeout "${HOST_TIMEOUT:-200}" python3 benchmarks/host_overhead_gpu.py \
    --shape "${HOST_SHAPE:-1,1024,16,128,128}" --json "$OUT/host_time.json" ${HOST_EXTRA:-} \
    > "$OUT/host_time.md" 2>&1
  echo "host time exit $?"; cat "$OUT/host_time.md"
}

run_layer() {  # issue 21: the conv alone and the whole layer against fla's (fla.layers from
  # .whl-fla: fla-core + flash-linear-attention, unpacked into /tmp/site-fla; flash_qla must
  # not be importable there, or fla's layer would dispatch to it)
  if compgen -G ".whl-fla/*.whl" > /dev/null; then
    for w in .whl-fla/*.whl; do python3 -m zipfile -e "$w" /tmp/site-fla; done
  fi
  local path="${SRC}/tmp/site-fla" shapes=()
  for s in ${LAYER_SHAPES:-1:32768 1:32768:8 4:8192 1:8192 1:65536:16}; do shapes+=(--shape "$s"); done
  PYTHONPATH=$path timeout "${CONV_TIMEOUT:-90}" python3 benchmarks/bench_conv.py --compare fla \
    > "$OUT/conv.md" 2>&1
  echo "conv exit $?"; grep -E '^\| (ours|fla) ' "$OUT/conv.md"
  PYTHONPATH=$path timeout "${LAYER_TIMEOUT:-330}" python3 benchmarks/bench_layer.py --compare fla \
    --no-check "${shapes[@]}" --warmup 10 --rep 40 ${LAYER_EXTRA:-} --out "$OUT/layer.md" \
    > "$OUT/layer.log" 2>&1
  echo "layer exit $?"; grep -E 'det:|fast:|fla:' "$OUT/layer.log" | cut -c1-160
}

if [[ $STAGES == *split* ]]; then run_split; fi
if [[ $STAGES == *pair* ]]; then run_pair; fi
if [[ $STAGES == *tests* ]]; then run_tests; fi
if [[ $STAGES == *sanitize* ]]; then run_sanitize; fi
if [[ $STAGES == *shapes* ]]; then run_cpu_shapes; fi
if [[ $STAGES == *bench* ]]; then run_bench; fi
if [[ $STAGES == *variants* ]]; then run_variants; fi
if [[ $STAGES == *kcp* ]]; then run_kcp; fi
if [[ $STAGES == *nccl* ]]; then run_nccl; fi
if [[ $STAGES == *bits* ]]; then run_bits; fi
if [[ $STAGES == *hosttime* ]]; then run_hosttime; fi
if [[ $STAGES == *layer* ]]; then run_layer; fi
# The device tool brings back a few files only: one archive per invocation holds this
# invocation's files (archives of earlier invocations in the same command are kept, not
# packed over: a second invocation once replaced the first one's gpu-test log).
ARCHIVE="all_${STAGES// /_}.tgz"
find "$OUT" -mindepth 1 -maxdepth 1 ! -name 'all*.tgz' -printf '%P\n' > /tmp/h200_out.list
tar czf /tmp/h200_out.tgz -C "$OUT" -T /tmp/h200_out.list \
  && (cd "$OUT" && xargs -d '\n' rm -rf < /tmp/h200_out.list) && mv /tmp/h200_out.tgz "$OUT/$ARCHIVE"
exit 0
