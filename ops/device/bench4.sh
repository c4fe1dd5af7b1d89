#!/usr/bin/env bash
# Fifth session's GPU runs (docs/benchmarks.md, "Skinny linear"), one device
# call each: STAGE=1 the skinny linear kernel (parity, kernel benchmark
# against cuBLAS) and decode with --linear auto|cublas, full and shadowkv;
# it needs commit 0852ece (the kernel was removed after this measurement).
# STAGE=2 and 3: the issue's sweep with 100 steps, two lanes with fetch turns
# (the default configuration), each context's batch built once and timed at
# several batch sizes and both hit rates (--batch-sweep, --hit-rates):
# STAGE=2 61440 and 124928, STAGE=3 249856 and 1048576. STAGE=4: the value
# fetch's width (--fetch-blocks) now that lanes take turns.
# Our benchmark and the peer in the same call.
source "$(dirname "$0")/bench_common.sh"
B="penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --steps 20 --context 124928"
F="penumbra-bench decode --kv-policy full --steps 20 --context 124928"
PEER="python3 .device/peer_full_attention.py decode --context 124928"
case "${STAGE:-1}" in
  1)
    PENUMBRA_KERNEL_BENCH=1 timeout 120 $R linear_skinny_gpu_test > "$OUT/linear_skinny_gpu_test.log" 2>&1
    echo "linear_skinny_gpu_test rc=$?"; grep -E "PASSED|FAILED|Failure" "$OUT/linear_skinny_gpu_test.log" | head -5
    grep '^{' "$OUT/linear_skinny_gpu_test.log" | tee -a "$J"
    run 100 $PEER
    run 90 $R $B --lanes 2 --force-hit-rate 0.6 --linear auto
    run 90 $R $B --lanes 2 --force-hit-rate 0.6 --linear cublas
    run 90 $R $F --linear auto
    run 90 $R $F --linear cublas
    run 90 $R $B --lanes 2 --linear auto
    run 100 $PEER ;;
  2)
    SW="penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --steps 100 --lanes 2 --hit-rates natural,0.6"
    run 200 python3 .device/peer_full_attention.py decode --steps 20 --context 124928 61440
    run 200 $R $SW --context 124928 --batch-sweep 2,4,8,14
    run 200 $R $SW --context 61440 --batch-sweep 2,4,8,16,28
    run 200 python3 .device/peer_full_attention.py decode --steps 20 --context 124928 61440 ;;
  3)
    SW="penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --steps 100 --hit-rates natural,0.6"
    run 150 python3 .device/peer_full_attention.py decode --steps 20 --context 249856
    run 200 $R $SW --lanes 2 --context 249856 --batch-sweep 2,4,7
    run 200 $R $SW --context 1048576 --batch 1
    run 150 python3 .device/peer_full_attention.py decode --steps 20 --context 249856 ;;
  4)
    timeout 120 $R shadowkv_decode_gpu_test --gtest_filter='ShadowkvFetchVGpu*' > "$OUT/fetch_gpu_test.log" 2>&1
    echo "fetch parity rc=$?"; grep -E "PASSED|FAILED" "$OUT/fetch_gpu_test.log" | head -3
    SW="penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --steps 100 --lanes 2 --hit-rates natural,0.6 --context 124928"
    run 100 python3 .device/peer_full_attention.py decode --steps 20 --context 124928
    for fb in 64 32 48; do run 130 $R $SW --fetch-blocks $fb; done ;;
esac
