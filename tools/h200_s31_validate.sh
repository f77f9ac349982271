#!/usr/bin/env bash
# The next session's device calls, back to back in one warm window (the machine keeps /tmp
# only while warm, ~30 s idle). Written in session 30 as h200_s30_validate.sh, which never
# ran (no device that session); session 31 got none either and added call t:
#
#   call t, no carry:                  bash tools/h200_s31_validate.sh t
#       every gpu-marked test of the four GDN packages (SUITE_WORKERS 6: an H100's memory;
#       session 33 reached 91 % in 420 s, 440 passed, so 500 s; it includes the formed
#       forward's test_gluon_fused_fwd_formed_gpu.py),
#       first: session 31 changed the eager autograd path (the saved set dropped at the end
#       of a backward that frees the graph, gdn_core.saved.graph_is_released) and the KCP
#       context (its group held weakly)
#   call 1b, no carry (~3 min):        bash tools/h200_s31_validate.sh 1b
#       the host profile, the device-thread probes plain and pinned, gdn_train's segment rule
#   call 1, no carry:                  bash tools/h200_s31_validate.sh 1
#       det's kernel table per segment size (1024, 2048, 4096, none) at B1 T32768, B4 T8192
#       and B1 T32768 in 8 equal documents: which kernels grow as segments shrink (the
#       question of docs/performance.md, "Exact against exact"); then simulated KCP at
#       world 8 (issue 19's target 4, last measured on an H100 in session 25: 1.434); and
#       the cProfile of a B1 T1024 step's host path and what the device thread makes
#       slower (device_thread_probe.py; issue 18)
#   call 2, carry [".whl-base"]:       bash tools/h200_s31_validate.sh 2
#   call 3, carry [".whl", ".whl-fla"]: bash tools/h200_s31_validate.sh 3
#       FlashQLA's kernel table at the same shapes and equal documents, with its default
#       (approximate split where it chooses one), beside det's; then issue 18's host time
#       against fla's Triton kernels with autograd's device thread and on the caller
export TAG=s31
source tools/h200_lib.sh
case ${1:?call t, 1b, 1, 2 or 3} in
  t)
    SUITE_WORKERS=${SUITE_WORKERS:-6} PROFILE=0 CALL_LIMIT=${CALL_LIMIT:-500} suite_step
    pack callt ;;
  1)
    # issue 18: where the host time of a B1 T1024 step goes now (cProfile, the floors)
    timeout 80 python3 benchmarks/host_profile_gpu.py --iters 50 --top 50 --repeats 3 \
      --launches 7 > "$LOG/host_profile_T1024.txt" 2>&1
    echo "host profile exit $?"; head -8 "$LOG/host_profile_T1024.txt"
    timeout 90 python3 benchmarks/device_thread_probe.py > "$LOG/device_thread_probe.txt" 2>&1
    echo "device thread probe exit $?"; tail -8 "$LOG/device_thread_probe.txt"
    timeout 90 python3 benchmarks/device_thread_probe.py --pin 3 \
      > "$LOG/device_thread_probe_pinned.txt" 2>&1
    echo "pinned probe exit $?"; tail -7 "$LOG/device_thread_probe_pinned.txt"
    timeout "${PROFILE_SECONDS:-300}" python3 benchmarks/profile_gdn.py \
      --shapes 1x32768x16x1,4x8192x16x1,1x32768x16x8 --segments 1024,2048,4096,0 \
      --iters 10 --rows 16 > "$LOG/profile_det_segments.txt" 2>&1
    echo "profile exit $?"; grep -E "^===|_kernel " "$LOG/profile_det_segments.txt" | cut -c1-60,150-200
    # target 4 both ways: with --busy-us (no rank charged the host's enqueue: session 18's
    # 1.015 on the H200) and without (rank 0 charged it where the host is slower:
    # session 25's 1.434 on the H100); kcp_host_cpu.py has the host side
    CALL_LIMIT=${CALL_LIMIT:-585} kcp_in_time 8 "--busy-us 3000" 160
    mv "$LOG/kcp_w8" "$LOG/kcp_w8_busy" 2>/dev/null
    CALL_LIMIT=${CALL_LIMIT:-585} kcp_in_time 8
    pack call1 ;;
  1b)  # the short form (what the device time left allowed): host, the probes, the rule
    timeout 80 python3 benchmarks/host_profile_gpu.py --iters 50 --top 50 --repeats 3 \
      --launches 7 > "$LOG/host_profile_T1024.txt" 2>&1
    echo "host profile exit $?"; head -8 "$LOG/host_profile_T1024.txt"
    timeout 60 python3 benchmarks/device_thread_probe.py --repeats 3 \
      > "$LOG/device_thread_probe.txt" 2>&1
    echo "device thread probe exit $?"; tail -7 "$LOG/device_thread_probe.txt"
    timeout 60 python3 benchmarks/device_thread_probe.py --repeats 3 --pin 3 \
      > "$LOG/device_thread_probe_pinned.txt" 2>&1
    echo "pinned probe exit $?"; tail -7 "$LOG/device_thread_probe_pinned.txt"
    # gdn_train's default segment rule (segment.choose_segment_size) against both paths
    timeout 120 python3 benchmarks/bench_gdn_train.py --arms det,nondet,det-plain --warmup 5 \
      --iters 20 --shapes "B1,T8192,H16;B4,T8192,H16;B1,T32768,H16,D8" --acc-shapes none \
      --json "$LOG/segment_rule.json" > "$LOG/segment_rule.md" 2>&1
    echo "segment rule exit $?"; grep -E "^\| B" "$LOG/segment_rule.md" | head -12
    pack call1b ;;
  2)
    install_base
    pack call2 ;;
  3)
    install_anchors || exit 1  # FlashQLA into /tmp/site, fla into /tmp/site-fla
    PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site-base" timeout "${PROFILE_SECONDS:-400}" \
      python3 benchmarks/profile_gdn.py --package flashqla \
      --shapes 1x32768x16x1,4x8192x16x1,1x32768x16x8 --segments 0 --iters 10 --rows 16 \
      > "$LOG/profile_flashqla.txt" 2>&1
    echo "profile exit $?"; grep -E "^===|_kernel " "$LOG/profile_flashqla.txt" | cut -c1-60,150-200
    host_vs_fla /tmp/site-fla:/tmp/site-base "" --backward-on-caller
    pack call3 ;;
esac
