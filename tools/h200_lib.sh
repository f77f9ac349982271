# Shared by the per-session device scripts (tools/h200_s<N>_validate.sh): source it with
# TAG set to the session's tag (s17, s18, ...). It sets OUT, LOG ($OUT/$TAG), PYTHONPATH
# (every package's src), START (for a call's time budget) and SHAPES6 (issue 19's six
# shapes), writes $LOG/env.txt, and defines:
#   e2e LABEL SHAPES   det fwd+bwd time and peak at SHAPES (e2e_<LABEL>.json, e2e.txt)
#   install_base       .whl-base into /tmp/site-base (FlashQLA's and tilelang's base wheels)
#   install_anchors    .whl and .whl-fla into /tmp/site and /tmp/site-fla (after install_base,
#                      in the same warm window: the machine keeps /tmp only while warm)
#   suite_step         every gpu-marked test of the four GDN packages (gpu_tests.log), det
#                      profiles at segments of 4096, then the CUDA bits against a carried .old
#                      in what is left of CALL_LIMIT (585 s); SUITE_THEN=FUNC runs FUNC after
#                      the tests, PROFILE=0 skips the profiles; SUITE_WORKERS (12) pytest
#                      workers: 12 fit the H200's memory, not an H100's (OOM, session 26)
#   anchors_step       (after install_base) det against FlashQLA at SHAPES6 in one run
#                      (qla.md/json), host time at B1 T1024 against fla (HOST_TIMEOUT, 230 s:
#                      fla compiles first; again with every arm pinned to CPU HOST_PIN if
#                      set), the benchmarks/ probes named in S3_PROBES, and
#                      KCP world 8 if 100 s of CALL_LIMIT are left
#   gpu_tests LOGFILE SECONDS WORKERS PATH...
#                      the gpu-marked tests of PATH... (pytest args) into $LOG/LOGFILE, then
#                      their exit status and summary lines; returns pytest's status (124:
#                      timed out)
#   kcp_in_time WORLDS [EXTRA] [MIN]
#                      simulated KCP (B1 T65536 H16 16 docs, 20 iterations, EXTRA appended
#                      to the benchmark's options) at each world of WORLDS while more than
#                      MIN (100) s of CALL_LIMIT are left, each into $LOG/kcp_w<W>/
#   ncu_run SECONDS LOGFILE ARGS...
#                      Nsight Compute (on PATH or under /opt/nvidia) with the clocks left
#                      alone, --profile-from-start off and NCU_SECTIONS, on ARGS (ncu
#                      options, then the command) into $LOG/LOGFILE; its status (1: no ncu)
#   ncu_details SECONDS NAME ARGS...
#                      ncu_run with NCU_DETAIL_SECTIONS (throughput, warp states, scheduler,
#                      launch, occupancy, memory) on ARGS into $LOG/NAME.ncu-rep, its details
#                      page exported as $LOG/details.csv (the report removed), the headline
#                      metrics printed
#   host_vs_fla SITE MODES...
#                      host_overhead_gpu.py at B1 T1024 against fla's own Triton kernels
#                      (--fla-force; fla from SITE, nothing else added to the path) once per
#                      MODE ("" or --backward-on-caller) into $LOG/host_T1024_fla<MODE>.txt,
#                      each within HOST_FLA_TIMEOUT (200) s
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

suite_step() {
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest -v -n ${SUITE_WORKERS:-12} -m gpu -p no:cacheprovider \
    -p gdn_core.pytest_cuda_guard --import-mode=importlib -ra packages/gdn-core/tests \
    packages/gdn-det-train/tests packages/gdn-train/tests packages/gdn-det-train-kcp/tests \
    > "$LOG/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"; grep -cE "PASSED" "$LOG/gpu_tests.log"
  grep -E "^(FAILED|ERROR) |passed|failed" "$LOG/gpu_tests.log" | sort | uniq | tail -25
  [[ -n ${SUITE_THEN:-} ]] && "$SUITE_THEN"
  if [[ ${PROFILE:-1} == 1 ]]; then
    timeout 90 python3 benchmarks/profile_gdn.py --shapes 1x32768x16x8,1x32768x16x1,1x8192x16x1 \
      --segments 4096 --iters 10 --rows 16 > "$LOG/profile_det.txt" 2>&1
    echo "profile exit $?"; grep -E "^===|_kernel " "$LOG/profile_det.txt" | cut -c1-60,150-200
  fi
  local left=$(( ${CALL_LIMIT:-585} - ($(date +%s) - START) ))
  echo "bits with ${left} s left"
  mkdir -p "$LOG/bits"  # its own folder: h200_validate.sh packs everything in its OUT
  OUT=$LOG/bits STAGES=bits BITS_TIMEOUT=$(( left > 60 ? left - 50 : 10 )) \
    bash tools/h200_validate.sh
}

anchors_step() {
  install_anchors || return 1
  local base=$PYTHONPATH
  export PYTHONPATH="$base:/tmp/site:/tmp/site-base"
  timeout 400 python3 benchmarks/bench_gdn_train.py --arms det --compare flashqla --warmup 5 \
    --iters 20 --shapes "$SHAPES6" --acc-shapes "B1,T512,H16" --warm-compile-jobs 6 \
    --json "$LOG/qla.json" > "$LOG/qla.md" 2>&1
  echo "qla exit $?"; grep -E "^\[.*(shape|det |flashqla |warm compile done)" "$LOG/qla.md" | cut -c1-200
  PYTHONPATH="$base:/tmp/site-fla:/tmp/site-base:/tmp/site" timeout ${HOST_TIMEOUT:-230} python3 \
    benchmarks/host_overhead_gpu.py --no-graph --iters 100 --repeats 3 > "$LOG/host_T1024_fla.txt" 2>&1
  echo "host exit $?"; cat "$LOG/host_T1024_fla.txt"
  if [[ -n ${HOST_PIN:-} ]]; then  # the same, every arm pinned to CPU HOST_PIN (fla compiled)
    PYTHONPATH="$base:/tmp/site-fla:/tmp/site-base:/tmp/site" timeout ${HOST_TIMEOUT:-230} \
      python3 benchmarks/host_overhead_gpu.py --no-graph --iters 100 --repeats 3 \
      --pin "$HOST_PIN" > "$LOG/host_T1024_fla_pinned.txt" 2>&1
    echo "host pinned exit $?"; cat "$LOG/host_T1024_fla_pinned.txt"
  fi
  [[ -n ${S3_PROBES:-} ]] && for p in $S3_PROBES; do
    timeout 90 python3 "benchmarks/$p" > "$LOG/${p%.py}.txt" 2>&1
    echo "$p exit $?"; cut -c1-200 "$LOG/${p%.py}.txt" | tail -24
  done
  kcp_in_time 8
}

gpu_tests() {
  local log=$1 secs=$2 workers=$3
  shift 3
  timeout "$secs" python3 -m pytest -v -n "$workers" -m gpu -p no:cacheprovider \
    -p gdn_core.pytest_cuda_guard --import-mode=importlib -ra "$@" > "$LOG/$log" 2>&1
  local rc=$?
  echo "tests exit $rc"; grep -E "^(FAILED|ERROR) |passed|failed" "$LOG/$log" | tail -15
  return $rc
}

kcp_in_time() {
  local W left
  for W in $1; do
    left=$(( ${CALL_LIMIT:-585} - ($(date +%s) - START) ))
    (( left > ${3:-100} )) || { echo "no time left for KCP world $W (${left} s)"; return 0; }
    # its own folder: h200_validate.sh packs (and removes) everything in its OUT
    mkdir -p "$LOG/kcp_w$W"
    OUT=$LOG/kcp_w$W STAGES=kcp KCP_WORLDS="$W" KCP_TIMEOUT=$(( left - 20 )) \
      KCP_EXTRA="--warmup 3 --iters 20 ${2:-}" bash tools/h200_validate.sh
  done
}

NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis"

ncu_run() {
  local secs=$1 log=$2 ncu
  shift 2
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [[ -n $ncu ]] || { echo "no ncu here"; return 1; }
  # shellcheck disable=SC2086 # NCU_SECTIONS is a list of options
  timeout "$secs" "$ncu" --clock-control none --profile-from-start off $NCU_SECTIONS "$@" \
    > "$LOG/$log" 2>&1
}

NCU_DETAIL_SECTIONS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis"

ncu_details() {
  local secs=$1 name=$2 ncu
  shift 2
  NCU_SECTIONS=$NCU_DETAIL_SECTIONS ncu_run "$secs" ncu.log -f -o "$LOG/$name" "$@"
  echo "ncu exit $?"; tail -3 "$LOG/ncu.log"
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout 60 "$ncu" -i "$LOG/$name.ncu-rep" --page details --csv > "$LOG/details.csv" 2>&1
  echo "details exit $?"; rm -f "$LOG/$name.ncu-rep"
  grep -E '"(Duration|DRAM Throughput|Warp Cycles Per Issued Instruction|No Eligible|Registers Per Thread|Achieved Occupancy|Block Size|Grid Size)"' \
    "$LOG/details.csv" | cut -d, -f5,13,15 | cut -c1-150 | head -80
}

host_vs_fla() {
  local site=$1 mode
  shift
  for mode in "$@"; do
    # fla autotunes its kernels on first use: 110 s was not always enough (session 29)
    PYTHONPATH="$PYTHONPATH:$site" timeout "${HOST_FLA_TIMEOUT:-200}" python3 benchmarks/host_overhead_gpu.py \
      --no-graph --iters 100 --repeats 3 --fla-force $mode > "$LOG/host_T1024_fla${mode}.txt" 2>&1
    echo "host $mode exit $?"; grep -vi warning "$LOG/host_T1024_fla${mode}.txt" | tail -7
  done
}

pack() {
  tar czf "$OUT/${TAG}_${1}.tgz" -C "$OUT" "$TAG" && rm -rf "${OUT:?}/$TAG"
}
