#!/usr/bin/env bash
# Set up, build and pass every test: C++ unit/integration tests (GPU tests skip
# themselves without a GPU), a short libFuzzer run of the safetensors parser,
# and the Python task-generator tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/setup.sh
bash ops/build.sh
(cd build && ctest --output-on-failure -j"$(nproc)" --timeout 1200)
bash .ci/fuzz.sh 30
python3 -m unittest discover -s ops/evalmodel -p 'test_*.py'
