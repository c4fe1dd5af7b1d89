#!/usr/bin/env bash
# Seventh session's GPU runs (docs/benchmarks.md), one device call each.
# STAGE=1: parity (shadowkv_decode_gpu_test, shadowkv_check_gpu_test) and the
# kernel benchmarks of the pipelined K rebuild and the fused score + top-k;
# the peer first and last; a traced 100-step decode at 124928 x 14, two lanes
# (forced 60%, natural), then the rebuild at 2 tiles-splits per row through
# the build's PENUMBRA_EXP_REBUILD_SPLITS hook.
# STAGE=2: each lane's streams on its own SM partition (a green context,
# PENUMBRA_EXP_LANE_SMS=N, a hook of that build) against the shared GPU, two
# lanes of 64 SMs and three of 40. The hook was removed afterwards (both
# slower than the shared GPU).
# STAGE=3: parity; the peer first and last; the build before the slot update
# joined the selection kernel (penumbra-bench-base, commit 801d87d) against
# the build with it; then the independent PyTorch reference check
# (ops/device/shadowkv_check.sh).
source "$(dirname "$0")/bench_common.sh"
export LD_LIBRARY_PATH=$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SW="penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --lanes 2 --context 124928"
PEER="python3 .device/peer_full_attention.py decode --steps 20 --context 124928"
parity() {
  for t in shadowkv_decode_gpu_test shadowkv_check_gpu_test; do
    timeout 200 $R $t > "$OUT/$t.log" 2>&1
    echo "$t rc=$?"; grep -E "PASSED|FAILED|Failure|Expected|Which|differ" "$OUT/$t.log" | head -12
  done
  PENUMBRA_KERNEL_BENCH=1 timeout 120 $R shadowkv_decode_gpu_test --gtest_filter='*Bench*' > "$OUT/decode_bench.log" 2>&1
  grep "bench" "$OUT/decode_bench.log" | head -20
}
case "${STAGE:-1}" in
  1)
    parity
    run 120 $PEER
    run 200 $R $SW --steps 100 --hit-rates 0.6,natural,0.6 --kernel-trace "$OUT/trace.jsonl"
    python3 ops/trace_summary.py "$OUT/trace.jsonl" --steps 100 | tee "$OUT/trace.txt"
    gzip "$OUT/trace.jsonl"
    run 150 env PENUMBRA_EXP_REBUILD_SPLITS=2 $R $SW --steps 100 --hit-rates 0.6
    run 120 $PEER ;;
  2)
    run 120 $PEER
    run 150 $R $SW --steps 100 --hit-rates 0.6
    run 150 env PENUMBRA_EXP_LANE_SMS=64 $R $SW --steps 100 --hit-rates 0.6,natural
    run 150 env PENUMBRA_EXP_LANE_SMS=64 $R $SW --steps 10 --hit-rates 0.6 --kernel-trace "$OUT/trace-green.jsonl"
    python3 ops/trace_summary.py "$OUT/trace-green.jsonl" --steps 10 | tee "$OUT/trace-green.txt"
    gzip "$OUT/trace-green.jsonl"
    run 150 env PENUMBRA_EXP_LANE_SMS=40 $R ${SW/--lanes 2/--lanes 3} --steps 100 --hit-rates 0.6
    run 120 $PEER ;;
  3)
    parity
    run 120 $PEER
    run 150 $R ${SW/penumbra-bench/penumbra-bench-base} --steps 100 --hit-rates 0.6
    run 150 $R $SW --steps 100 --hit-rates 0.6,natural,0.6
    run 120 $PEER
    timeout 300 bash ops/device/shadowkv_check.sh > "$OUT/shadowkv_check.log" 2>&1
    echo "shadowkv_check rc=$?"; grep -E "^(PASS|FAIL)" "$OUT/shadowkv_check.log" ;;
esac
