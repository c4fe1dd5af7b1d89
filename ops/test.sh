#!/usr/bin/env bash
# Set up, build and pass every test: the format check, C++ unit/integration/
# service tests (GPU tests skip themselves without a GPU), short libFuzzer
# runs, the Python tests, clang-tidy, and the sanitizer jobs (the CPU tests,
# service processes included, under ASan+UBSan; the threaded parts, the
# service and the store node under TSan; ops/sanitize.sh). Set-up
# and build print one line each (their output goes to build*/logs/, shown in
# full only on failure).
set -euo pipefail
cd "$(dirname "$0")/.."
source ops/quiet.sh
LOGS=build/logs
quiet_step "setup: Debian packages (log: $LOGS/setup.log)" "$LOGS/setup.log" bash ops/setup.sh
bash ops/format.sh --check
quiet_step "build: everything (log: $LOGS/build.log)" "$LOGS/build.log" bash ops/build.sh
(cd build && ctest --output-on-failure -j"$(nproc)" --timeout 1200)
bash .ci/fuzz.sh 30
python3 -m unittest discover -s ops/evalmodel -p 'test_*.py'
quiet_step "clang-tidy (log: $LOGS/tidy.log)" "$LOGS/tidy.log" bash ops/tidy.sh build
bash ops/sanitize.sh asan
bash ops/sanitize.sh tsan
