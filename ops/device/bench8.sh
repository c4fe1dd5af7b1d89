#!/usr/bin/env bash
# Ninth session's GPU runs (docs/benchmarks.md), one device call each.
# STAGE=1 (calls 1-2, on the builds of two fused variants that were then
# dropped: an RMSNorm prologue in every block of the next projection, then an
# RMSNorm epilogue in the last block of the O/down projections, each with the
# SwiGLU epilogue): the kernel GPU tests the skinny kernel touches, with its
# benchmarks; stories260K greedy on CUDA bf16 with --linear auto, skinny and
# cublas, against each other and the golden; the peer first and last;
# forced-60% decode at 124928 x 14 (two lanes, 100 steps) with --linear auto,
# skinny, auto; a 30-step kernel trace with a chain sample.
# STAGE=2 (call 3, the committed build: auto = the SwiGLU epilogue only): the
# same tests and stories; the peer first and last; forced 60% (and natural)
# with --linear auto, then skinny, auto, skinny on fresh sequences each.
# STAGE=3 (call 4, the committed build): the peer first and last; forced 60%
# with the defaults twice more; full-attention decode at 124928 (issue 2's
# shape, the defaults); ShadowKV at 1048576 tokens, batch 1, natural and
# forced 60%.
source "$(dirname "$0")/bench_common.sh"
export LD_LIBRARY_PATH=$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SW="penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --lanes 2 --context 124928"
PEER="python3 .device/peer_full_attention.py decode --steps 20 --context 124928"
stories() {
  for lin in auto skinny cublas; do
    timeout 60 $R penumbra generate --model .device/stories260K --prompt-ids 1 --max-new-tokens 200 --greedy --json \
      --device cuda --dtype bf16 --linear $lin > "$OUT/stories_$lin.json" 2> "$OUT/stories_$lin.err"
    echo "stories $lin rc=$?"
  done
  python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]; g = json.load(open('.device/stories260K/golden_greedy.json'))['greedy_ids']
ids = {}
for lin in ('auto', 'skinny', 'cublas'):
    try:
        ids[lin] = json.load(open(f'{out}/stories_{lin}.json'))['ids']
    except Exception as e:
        print(lin, 'error', e); continue
    first = next((i for i, (a, b) in enumerate(zip(ids[lin], g)) if a != b), None)
    print(f'stories260K cuda bf16 --linear {lin}: golden exact={ids[lin] == g} first_divergence={first}')
if 'auto' in ids and 'skinny' in ids:
    print('auto (fused) == skinny (unfused):', ids['auto'] == ids['skinny'])
PY
}
# gpu_tests PATTERN TEST...: each test (the skinny kernel's with its
# benchmarks), its last summary line, then the benchmark lines matching PATTERN.
gpu_tests() {
  local pattern=$1; shift
  for t in "$@"; do
    PENUMBRA_KERNEL_BENCH=$([ $t = linear_skinny_gpu_test ] && echo 1 || echo 0) timeout 150 $R $t >> "$OUT/tests.log" 2>&1
    echo "$t rc=$?"; grep -E "PASSED|FAILED|Failure" "$OUT/tests.log" | tail -1
  done
  grep -E "^\\{\"bench\":\"$pattern" "$OUT/tests.log"
}
case "${STAGE:-1}" in
  1)
    gpu_tests skinny_fused linear_skinny_gpu_test pointwise_gpu_test shadowkv_decode_gpu_test shadowkv_check_gpu_test \
      kernel_trace_gpu_test
    stories
    run 120 $PEER
    run 150 $R $SW --steps 100 --hit-rates 0.6
    run 150 $R $SW --steps 100 --hit-rates 0.6 --linear skinny
    run 150 $R $SW --steps 100 --hit-rates 0.6
    run 150 $R $SW --steps 30 --hit-rates 0.6 --kernel-trace "$OUT/trace.jsonl"
    python3 ops/trace_summary.py "$OUT/trace.jsonl" --steps 30 --chain > "$OUT/trace.txt" 2>&1; gzip "$OUT/trace.jsonl"
    grep -E "fetch_to_next|link_busy|window" "$OUT/trace.txt"; sed -n '/chain sample/,$p' "$OUT/trace.txt" | head -40
    run 120 $PEER ;;
  2)
    gpu_tests skinny_swiglu linear_skinny_gpu_test shadowkv_decode_gpu_test shadowkv_check_gpu_test
    stories
    run 120 $PEER
    run 200 $R $SW --steps 100 --hit-rates 0.6,natural
    run 150 $R $SW --steps 100 --hit-rates 0.6 --linear skinny
    run 150 $R $SW --steps 100 --hit-rates 0.6
    run 150 $R $SW --steps 100 --hit-rates 0.6 --linear skinny
    run 120 $PEER ;;
  3)
    run 120 $PEER
    run 150 $R $SW --steps 100 --hit-rates 0.6
    run 150 $R $SW --steps 100 --hit-rates 0.6
    run 120 $R penumbra-bench decode --context 124928 --steps 20
    run 200 $R penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --steps 100 --hit-rates natural,0.6 \
      --context 1048576 --batch 1
    run 120 $PEER ;;
esac
