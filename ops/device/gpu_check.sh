#!/usr/bin/env bash
# One GPU-machine run of the correctness work: kernel parity tests, the
# stories260K golden on the GPU (bf16 and f32), Hugging Face and tokenizer
# goldens, written under $OUT. Run from the repository root with the bundle
# in .device (ops/device/README.md).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/gpu.txt"
R="bash .device/run"
for t in pointwise_gpu_test attention_gpu_test lowrank_gpu_test shadowkv_prefill_gpu_test shadowkv_decode_gpu_test; do
  echo "== $t"; timeout 120 $R $t --gtest_brief=1 > "$OUT/$t.log" 2>&1; echo "rc=$?"; grep -E "PASSED|FAILED|Failure" "$OUT/$t.log" | head -8
done
for dt in bf16 f32; do
  timeout 60 $R penumbra generate --model .device/stories260K --prompt-ids 1 --max-new-tokens 200 --greedy --json --device cuda --dtype $dt > "$OUT/stories_$dt.json" 2> "$OUT/stories_$dt.err"; echo "stories $dt rc=$?"
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]; g = json.load(open('.device/stories260K/golden_greedy.json'))['greedy_ids']
for dt in ('bf16', 'f32'):
    try:
        ids = json.load(open(f'{out}/stories_{dt}.json'))['ids']
    except Exception as e:
        print(dt, 'error', e); continue
    first = next((i for i, (a, b) in enumerate(zip(ids, g)) if a != b), None)
    print(f'stories260K cuda {dt}: exact={ids == g} first_divergence={first}')
PY
timeout 150 python3 tests/tools/make_hf_goldens.py --out "$OUT/hf" > "$OUT/hf.log" 2>&1; echo "hf goldens rc=$?"; tail -3 "$OUT/hf.log"
timeout 60 python3 tests/tools/make_tokenizer_goldens.py --help > /dev/null 2>&1 && {
  mkdir -p "$OUT/tok"; timeout 120 python3 tests/tools/make_tokenizer_goldens.py .device/tokenizers "$OUT/tok" > "$OUT/tok.log" 2>&1; echo "tok goldens rc=$?"; tail -2 "$OUT/tok.log"; }
(cd "$OUT" && tar czf goldens.tgz hf tok 2>/dev/null; rm -rf hf tok)
