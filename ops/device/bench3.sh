#!/usr/bin/env bash
# Fourth session's GPU runs (docs/benchmarks.md, "Fetch turns"), one device
# call each: STAGE=1 parity + profile after the batched compression and the
# compacted fetch; STAGE=2 the fetch timeline (lanes, widths, compute floor);
# STAGE=3 fetch turns on/off. Our benchmark and the peer in the same call.
source "$(dirname "$0")/bench_common.sh"
B="penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --steps 20 --context 124928"
PEER="python3 .device/peer_full_attention.py decode --context 124928"
case "${STAGE:-3}" in
  1)
    for t in lowrank_gpu_test shadowkv_prefill_gpu_test shadowkv_decode_gpu_test shadowkv_check_gpu_test; do
      timeout 120 $R $t --gtest_brief=1 > "$OUT/$t.log" 2>&1; echo "$t rc=$?"; grep -E "PASSED|FAILED" "$OUT/$t.log" | head -5
    done
    run 150 $PEER
    run 150 $R $B --force-hit-rate 0.6 --profile
    run 150 $R $B --force-hit-rate 0.6 --lanes 2 --fetch-timeline
    run 150 $R $B --lanes 2 --fetch-timeline
    run 150 $R $B --force-hit-rate 0.6 --lanes 2 ;;
  2)
    run 100 $PEER
    run 80 $R $B --lanes 2 --fetch-timeline
    run 80 $R $B --lanes 3 --fetch-timeline
    run 80 $R $B --lanes 2 --force-hit-rate 1.0 ;;
  3)
    run 100 $PEER
    run 90 $R $B --lanes 2 --fetch-turns on --force-hit-rate 0.6
    run 90 $R $B --lanes 2 --fetch-turns off
    run 90 $R $B --lanes 2 --fetch-turns off --force-hit-rate 0.6
    run 90 $R $B --lanes 2 --fetch-turns on
    run 100 $PEER ;;
esac
