#!/usr/bin/env bash
# The main job on its embedded default: set up, build, and ask the project's
# own long-context model (models/penumbra-eval, docs/evalmodel.md) a question
# about a 4K-token document (ops/examples/needle_4k.txt: Python
# documentation with one hidden fact), on the GPU when there is one, else on
# the CPU. Set-up and build print one line each (their output goes to
# build/logs/, shown in full only on failure); then the answer and the speed.
# Extra arguments go to `penumbra generate` (e.g. --kv-policy shadowkv
# --min-prompt 1024). PENUMBRA_MODEL=DIR runs another model from token id 1.
set -euo pipefail
cd "$(dirname "$0")/.."
source ops/quiet.sh
LOGS=build/logs
quiet_step "setup: Debian packages (log: $LOGS/setup.log)" "$LOGS/setup.log" bash ops/setup.sh
quiet_step "build: penumbra (log: $LOGS/build.log; the first build takes a few minutes)" "$LOGS/build.log" \
  bash ops/build.sh penumbra
if [ -n "${PENUMBRA_MODEL:-}" ]; then
  exec ./build/bin/penumbra generate --model "$PENUMBRA_MODEL" --prompt-ids 1 --max-new-tokens 200 --greedy "$@"
fi
echo
echo "Q: What is the special magic number for witty-pond? (asked about a 4K-token document; expected 3652018)"
# Stops at the end of the answer line (token 201 is "\n") or at EOS (1).
./build/bin/penumbra generate --model models/penumbra-eval --prompt-file ops/examples/needle_4k.txt \
  --max-new-tokens 16 --greedy --stop-ids 201,1 --json "$@" > build/logs/answer.json
python3 - build/logs/answer.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("A:", r["text"].strip())
print(f'({r["prompt_tokens"]} prompt tokens, prefill {r["prefill_seconds"]:.2f} s; '
      f'{r["generated_tokens"]} tokens generated, decode {r["tokens_per_s"]:.1f} tokens/s; '
      f'{r["device"]} {r["dtype"]}, KV policy {r["kv_policy"]})')
PY
