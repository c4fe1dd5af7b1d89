#!/usr/bin/env bash
# The main job on its embedded default: set up, build, and generate with the
# small real model in ../shared (stories260K) on the GPU when there is one,
# else on the CPU; prints the text, then the speed on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/setup.sh
bash ops/build.sh penumbra
model=${PENUMBRA_MODEL:-../shared/models/stories260K}
exec ./build/bin/penumbra generate --model "$model" --prompt-ids 1 --max-new-tokens 200 --greedy "$@"
