#!/usr/bin/env bash
# Sixth session's GPU runs (docs/benchmarks.md), one device call each.
# STAGE=1: a kernel trace (--kernel-trace, CUPTI) of 10 decode steps at
# 124928 x 14, two lanes, forced 60%, then the same steps untraced on the same
# sequences; ops/trace_summary.py summarizes the trace on the machine.
# STAGE=2 and 3 compared variants through environment hooks of those builds
# (PENUMBRA_EXP_SIDE_PRIORITY=1: the side stream of the value fetch at the
# greatest priority; PENUMBRA_EXP_REBUILD_WAVES=N: the K rebuild's grid in
# waves of one block per SM), removed afterwards: the priority gained nothing,
# and one wave became the fixed grid (kernels/shadowkv_decode.cu). STAGE=2:
# before / priority / one wave / both (traced). STAGE=3 (one wave, top-k
# preload, score-final loads): parity, kernel benchmarks, with and without
# priority, 3 lanes. STAGE=4 (the committed build: + top-k with 1024 threads
# and per-bin aggregation): parity, kernel benchmarks, traced and untraced
# decode. STAGE=5: the same build beside Penumbra's full attention, as a
# check of the machine's speed against the peer's. The peer runs first and
# last in STAGE=2..5. STAGE=6: the CUPTI GPU test, then one block per SM
# against 56 blocks for the K rebuild (PENUMBRA_EXP_REBUILD_BLOCKS, a hook of
# that build, removed when 56 blocks = rows became the rule).
# libcupti travels in .device/lib (the bundle leaves CUDA libraries out).
source "$(dirname "$0")/bench_common.sh"
export LD_LIBRARY_PATH=$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SW="penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --lanes 2 --context 124928"
case "${STAGE:-1}" in
  1)
    run 200 $R $SW --steps 10 --hit-rates 0.6,0.6,natural --kernel-trace "$OUT/trace-forced.jsonl"
    python3 ops/trace_summary.py "$OUT/trace-forced.jsonl" --steps 10 | tee "$OUT/trace-forced.txt"
    gzip -k "$OUT/trace-forced.jsonl" && rm "$OUT/trace-forced.jsonl" ;;
  2)
    PEER="python3 .device/peer_full_attention.py decode --steps 20 --context 124928"
    run 120 $PEER
    run 150 $R $SW --steps 30 --hit-rates 0.6,natural
    run 150 env PENUMBRA_EXP_SIDE_PRIORITY=1 $R $SW --steps 30 --hit-rates 0.6,natural
    run 150 env PENUMBRA_EXP_REBUILD_WAVES=1 $R $SW --steps 30 --hit-rates 0.6,natural
    run 150 env PENUMBRA_EXP_SIDE_PRIORITY=1 PENUMBRA_EXP_REBUILD_WAVES=1 $R $SW --steps 10 --hit-rates 0.6,0.6,natural --kernel-trace "$OUT/trace-x3.jsonl"
    python3 ops/trace_summary.py "$OUT/trace-x3.jsonl" --steps 10 | tee "$OUT/trace-x3.txt"
    gzip -k "$OUT/trace-x3.jsonl" && rm "$OUT/trace-x3.jsonl"
    run 120 $PEER ;;
  3)
    timeout 150 $R shadowkv_decode_gpu_test > "$OUT/decode_gpu_test.log" 2>&1
    echo "parity rc=$?"; grep -E "PASSED|FAILED|Failure" "$OUT/decode_gpu_test.log" | head -8
    PENUMBRA_KERNEL_BENCH=1 timeout 120 $R shadowkv_decode_gpu_test --gtest_filter='*Bench*' > "$OUT/decode_bench.log" 2>&1
    grep -iE "ms|bench" "$OUT/decode_bench.log" | head -20
    PEER="python3 .device/peer_full_attention.py decode --steps 20 --context 124928"
    run 120 $PEER
    run 150 $R $SW --steps 100 --hit-rates 0.6,natural
    run 170 env PENUMBRA_EXP_SIDE_PRIORITY=1 $R $SW --steps 100 --hit-rates 0.6,0.6,natural --kernel-trace "$OUT/trace-x3.jsonl"
    python3 ops/trace_summary.py "$OUT/trace-x3.jsonl" --steps 100 | tee "$OUT/trace-x3.txt"
    gzip "$OUT/trace-x3.jsonl"
    run 150 env PENUMBRA_EXP_SIDE_PRIORITY=1 $R ${SW/--lanes 2/--lanes 3} --steps 100 --hit-rates 0.6
    run 120 $PEER ;;
  4)
    timeout 150 $R shadowkv_decode_gpu_test > "$OUT/decode_gpu_test.log" 2>&1
    echo "parity rc=$?"; grep -E "PASSED|FAILED|Failure" "$OUT/decode_gpu_test.log" | head -8
    PENUMBRA_KERNEL_BENCH=1 timeout 120 $R shadowkv_decode_gpu_test --gtest_filter='*Bench*' > "$OUT/decode_bench.log" 2>&1
    grep "bench" "$OUT/decode_bench.log" | head -20
    PEER="python3 .device/peer_full_attention.py decode --steps 20 --context 124928"
    run 120 $PEER
    run 170 $R $SW --steps 100 --hit-rates 0.6,natural,0.6 --kernel-trace "$OUT/trace-final.jsonl"
    python3 ops/trace_summary.py "$OUT/trace-final.jsonl" --steps 100 | tee "$OUT/trace-final.txt"
    gzip "$OUT/trace-final.jsonl"
    run 120 $PEER ;;
  5)
    PEER="python3 .device/peer_full_attention.py decode --steps 20 --context 124928"
    run 120 $PEER
    run 90 $R penumbra-bench decode --kv-policy full --steps 20 --context 124928
    run 150 $R $SW --steps 100 --hit-rates 0.6,natural
    run 120 $PEER ;;
  6)
    timeout 60 $R kernel_trace_gpu_test > "$OUT/kernel_trace_gpu_test.log" 2>&1
    echo "kernel_trace_gpu_test rc=$?"; grep -E "PASSED|FAILED|SKIPPED|Failure|Expected|Which" "$OUT/kernel_trace_gpu_test.log" | head -12
    PEER="python3 .device/peer_full_attention.py decode --steps 20 --context 124928"
    run 120 $PEER
    run 120 $R $SW --steps 100 --hit-rates 0.6
    run 120 env PENUMBRA_EXP_REBUILD_BLOCKS=56 $R $SW --steps 100 --hit-rates 0.6 ;;
esac
