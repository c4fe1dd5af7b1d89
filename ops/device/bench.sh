#!/usr/bin/env bash
# One GPU-machine run of the throughput benchmarks beside the full-attention
# peer (../shared/bench/peer_full_attention.py, bundled as .device/peer_full_attention.py).
# Every line printed is a JSON object; they are collected in $OUT/bench.jsonl.
# Usage: ops/device/bench.sh full|decode|shadowkv|lanes|micro
#   decode: full-attention decode only; lanes: shadowkv decode split over 1-3
#   engine lanes (one weights copy, one stream and host thread per lane).
source "$(dirname "$0")/bench_common.sh"
case "${1:-full}" in
  full)
    run 200 python3 .device/peer_full_attention.py decode --context 61440 124928
    run 150 $R penumbra-bench decode --context 61440,124928 --steps 20
    run 120 python3 .device/peer_full_attention.py prefill --context 124928
    run 150 $R penumbra-bench prefill --context 124928
    ;;
  decode)
    run 200 python3 .device/peer_full_attention.py decode --context 61440 124928
    run 150 $R penumbra-bench decode --context 61440,124928 --steps 20
    ;;
  lanes)
    run 200 python3 .device/peer_full_attention.py decode --context 124928
    S="$R penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --steps 20 --context 124928"
    run 150 $S --force-hit-rate 0.6 --lanes 2
    run 150 $S --lanes 2
    run 150 $S --force-hit-rate 0.6
    ;;
  micro)   # ShadowKV micro-batches (one weights read per layer) vs one batch
    run 200 python3 .device/peer_full_attention.py decode --context 124928
    S="$R penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --steps 20 --context 124928"
    run 150 $S --force-hit-rate 0.6
    run 150 $S --force-hit-rate 0.6 --micro-batches 2
    run 150 $S --micro-batches 2
    run 150 $S --force-hit-rate 0.6 --micro-batches 2 --lanes 2
    ;;
  shadowkv)
    run 200 python3 .device/peer_full_attention.py decode --context 124928 61440
    run 200 $R penumbra-bench decode --kv-policy shadowkv --context 124928 --force-hit-rate 0.6 --steps 20
    run 120 $R penumbra-bench decode --kv-policy shadowkv --context 124928 --steps 20 --batch 4
    run 120 $R penumbra-bench decode --kv-policy shadowkv --context 1048576 --steps 5 --batch 1
    ;;
esac
