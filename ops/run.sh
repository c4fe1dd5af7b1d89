#!/usr/bin/env bash
# The main job on its embedded default: set up, build, and ask the project's
# own long-context model (models/penumbra-eval, docs/evalmodel.md) a question
# about a 4K-token document (ops/examples/needle_4k.txt: Python
# documentation with one hidden fact), on the GPU when there is one, else on
# the CPU. Prints the answer, then the speed on stderr. Extra arguments go to
# `penumbra generate` (e.g. --kv-policy shadowkv --min-prompt 1024).
# PENUMBRA_MODEL=DIR runs another model from token id 1 instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/setup.sh
bash ops/build.sh penumbra
if [ -n "${PENUMBRA_MODEL:-}" ]; then
  exec ./build/bin/penumbra generate --model "$PENUMBRA_MODEL" --prompt-ids 1 --max-new-tokens 200 --greedy "$@"
fi
echo "Q: What is the special magic number for witty-pond? (in a 4K-token document; expected 3652018)" >&2
# Stops at the end of the answer line (token 201 is "\n") or at EOS (1).
exec ./build/bin/penumbra generate --model models/penumbra-eval --prompt-file ops/examples/needle_4k.txt \
  --max-new-tokens 16 --greedy --stop-ids 201,1 "$@"
