#!/usr/bin/env bash
# Second GPU run: the rest of the ShadowKV measurements beside the peer.
source "$(dirname "$0")/bench_common.sh"
timeout 120 $R lowrank_gpu_test --gtest_brief=1 > "$OUT/lowrank_gpu_test.log" 2>&1; echo "lowrank rc=$?"; grep -E "PASSED|FAILED" "$OUT/lowrank_gpu_test.log"
run 150 python3 .device/peer_full_attention.py decode --context 124928 249856
run 200 $R penumbra-bench decode --kv-policy shadowkv --context 124928 --steps 20
run 120 $R penumbra-bench decode --kv-policy shadowkv --context 249856 --force-hit-rate 0.6 --steps 20
run 60 $R penumbra-bench decode --kv-policy shadowkv --context 124928 --force-hit-rate 0.6 --steps 20 --batch 4
run 60 $R penumbra-bench decode --kv-policy shadowkv --context 124928 --force-hit-rate 0.6 --steps 20 --batch 4 --value-fetch staging
run 100 $R penumbra-bench prefill --kv-policy shadowkv --context 124928 --profile
