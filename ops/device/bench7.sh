#!/usr/bin/env bash
# Eighth session's GPU runs (docs/benchmarks.md), one device call each.
# STAGE=1: the skinny linear kernel's parity test and kernel benchmark; the
# peer first and last; forced-60% decode at 124928 x 14 (two lanes, 100
# steps) with cuBLAS everywhere, with the skinny kernel for the O and down
# projections (PENUMBRA_EXP_SKINNY=1, a hook of that build), without the
# lanes' round pairing at step begin (PENUMBRA_EXP_NOPAIR), and three lanes.
# STAGE=2: every kernel GPU test with chained launches on (PENUMBRA_EXP_PDL)
# and 512-chunk scoring splits (PENUMBRA_EXP_SCORE_SPLIT); the scoring kernel
# benchmark at 1024, 512 and 256-chunk splits; the peer first and last;
# forced-60% decode with the skinny O/down projections, then + chained
# launches, then + 512-chunk splits; a 30-step kernel trace of the second.
# STAGE=3: the skinny kernel's test with chained launches (W prefetched to L2
# before the wait); the peer first and last; forced 60% with chained launches
# and the skinny kernel for O/down only (SKINNY=1) or for every projection
# (SKINNY=2), at 512- and 256-chunk scoring splits; a 30-step trace.
# (Those PENUMBRA_EXP_* hooks were removed after the calls: the committed
# build runs the skinny kernel for every projection at <= 8 rows, chained
# launches and 512-chunk splits by default.)
# STAGE=4: the committed build: every GPU test; the peer first and last;
# forced 60% / natural / forced 60% at 124928 x 14 (two lanes, 100 steps);
# the same build with --linear cublas --chained-launch off (the previous
# kernels' path) at forced 60%; the independent PyTorch reference check.
# STAGE=5: the peer first and last; natural and forced 60% with the defaults,
# then both with --linear cublas --chained-launch off, on the same sequences.
source "$(dirname "$0")/bench_common.sh"
export LD_LIBRARY_PATH=$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SW="penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --lanes 2 --context 124928"
PEER="python3 .device/peer_full_attention.py decode --steps 20 --context 124928"
case "${STAGE:-1}" in
  1)
    PENUMBRA_KERNEL_BENCH=1 timeout 120 $R linear_skinny_gpu_test > "$OUT/linear_skinny_gpu_test.log" 2>&1
    echo "linear_skinny_gpu_test rc=$?"; grep -E "PASSED|FAILED|Failure|bench|GB/s" "$OUT/linear_skinny_gpu_test.log" | head -30
    run 120 $PEER
    run 150 $R $SW --steps 100 --hit-rates 0.6
    run 150 env PENUMBRA_EXP_SKINNY=1 $R $SW --steps 100 --hit-rates 0.6
    run 150 env PENUMBRA_EXP_SKINNY=1 PENUMBRA_EXP_NOPAIR=1 $R $SW --steps 100 --hit-rates 0.6
    run 150 env PENUMBRA_EXP_NOPAIR=1 $R $SW --steps 100 --hit-rates 0.6
    run 150 env PENUMBRA_EXP_SKINNY=1 $R ${SW/--lanes 2/--lanes 3} --steps 100 --hit-rates 0.6
    run 120 $PEER ;;
  2)
    for t in attention_gpu_test pointwise_gpu_test linear_skinny_gpu_test shadowkv_decode_gpu_test shadowkv_check_gpu_test; do
      PENUMBRA_EXP_PDL=1 PENUMBRA_EXP_SCORE_SPLIT=512 timeout 120 $R $t > "$OUT/$t.log" 2>&1
      echo "$t rc=$?"; grep -E "PASSED|FAILED|Failure|Expected|Which|differ" "$OUT/$t.log" | head -8
    done
    for sp in 1024 512 256; do
      PENUMBRA_EXP_SCORE_SPLIT=$sp PENUMBRA_KERNEL_BENCH=1 timeout 60 $R shadowkv_decode_gpu_test --gtest_filter='*Bench*' > "$OUT/decode_bench_$sp.log" 2>&1
      echo "split $sp: $(grep 'bench\] score' "$OUT/decode_bench_$sp.log")"
    done
    run 120 $PEER
    run 150 env PENUMBRA_EXP_SKINNY=1 $R $SW --steps 100 --hit-rates 0.6
    run 150 env PENUMBRA_EXP_SKINNY=1 PENUMBRA_EXP_PDL=1 $R $SW --steps 100 --hit-rates 0.6
    run 150 env PENUMBRA_EXP_SKINNY=1 PENUMBRA_EXP_PDL=1 PENUMBRA_EXP_SCORE_SPLIT=512 $R $SW --steps 100 --hit-rates 0.6
    run 150 env PENUMBRA_EXP_SKINNY=1 PENUMBRA_EXP_PDL=1 $R $SW --steps 30 --hit-rates 0.6 --kernel-trace "$OUT/trace.jsonl"
    python3 ops/trace_summary.py "$OUT/trace.jsonl" --steps 30 > "$OUT/trace.txt" 2>&1; gzip "$OUT/trace.jsonl"
    run 120 $PEER ;;
  3)
    PENUMBRA_EXP_PDL=1 timeout 120 $R linear_skinny_gpu_test > "$OUT/tests.log" 2>&1
    echo "linear_skinny_gpu_test rc=$?"; grep -E "PASSED|FAILED|Failure" "$OUT/tests.log" | head -8
    export PENUMBRA_EXP_PDL=1
    run 120 $PEER
    run 150 env PENUMBRA_EXP_SKINNY=1 PENUMBRA_EXP_SCORE_SPLIT=512 $R $SW --steps 100 --hit-rates 0.6
    run 150 env PENUMBRA_EXP_SKINNY=2 PENUMBRA_EXP_SCORE_SPLIT=512 $R $SW --steps 100 --hit-rates 0.6
    run 150 env PENUMBRA_EXP_SKINNY=2 PENUMBRA_EXP_SCORE_SPLIT=256 $R $SW --steps 100 --hit-rates 0.6
    run 150 env PENUMBRA_EXP_SKINNY=2 PENUMBRA_EXP_SCORE_SPLIT=512 $R $SW --steps 30 --hit-rates 0.6 --kernel-trace "$OUT/trace.jsonl"
    python3 ops/trace_summary.py "$OUT/trace.jsonl" --steps 30 > "$OUT/trace.txt" 2>&1; gzip "$OUT/trace.jsonl"
    python3 .device/chain.py "$OUT/trace.jsonl.gz" 2>&1 | head -60
    run 120 $PEER ;;
  4)
    for t in attention_gpu_test pointwise_gpu_test linear_skinny_gpu_test lowrank_gpu_test shadowkv_prefill_gpu_test \
             shadowkv_decode_gpu_test shadowkv_check_gpu_test kernel_trace_gpu_test; do
      timeout 150 $R $t >> "$OUT/tests.log" 2>&1
      echo "$t rc=$?"; grep -E "PASSED|FAILED|Failure" "$OUT/tests.log" | tail -1
    done
    run 120 $PEER
    run 300 $R $SW --steps 100 --hit-rates 0.6,natural,0.6
    run 150 $R $SW --steps 100 --hit-rates 0.6 --linear cublas --chained-launch off
    run 120 $PEER
    OUT="$OUT/skv" timeout 300 bash ops/device/shadowkv_check.sh > "$OUT/shadowkv_check.log" 2>&1
    echo "shadowkv_check rc=$?"; grep -E "^(PASS|FAIL)" "$OUT/shadowkv_check.log"
    tar -C "$OUT" -czf "$OUT/shadowkv_check.tar.gz" skv && rm -rf "$OUT/skv" ;;
  5)
    run 120 $PEER
    run 200 $R $SW --steps 100 --hit-rates natural,0.6
    run 200 $R $SW --steps 100 --hit-rates natural,0.6 --linear cublas --chained-launch off
    run 120 $PEER ;;
esac
