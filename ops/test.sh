#!/usr/bin/env bash
# Set up, build and pass every test: C++ unit/integration tests (GPU tests skip
# themselves without a GPU), a short libFuzzer run of the safetensors parser,
# and the Python task-generator tests. Set-up and build print one line each
# (their output goes to build/logs/, shown in full only on failure).
set -euo pipefail
cd "$(dirname "$0")/.."
source ops/quiet.sh
LOGS=build/logs
quiet_step "setup: Debian packages (log: $LOGS/setup.log)" "$LOGS/setup.log" bash ops/setup.sh
quiet_step "build: everything (log: $LOGS/build.log)" "$LOGS/build.log" bash ops/build.sh
(cd build && ctest --output-on-failure -j"$(nproc)" --timeout 1200)
bash .ci/fuzz.sh 30
python3 -m unittest discover -s ops/evalmodel -p 'test_*.py'
