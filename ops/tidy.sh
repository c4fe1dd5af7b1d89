#!/usr/bin/env bash
# Runs clang-tidy (the checks in .clang-tidy; clang-tidy 14, Debian's
# `clang-tidy`) over the C++ sources of a build's compile_commands.json.
#   bash ops/tidy.sh [BUILD_DIR] [FILE_REGEX]   default: build, every
#                                               first-party .cc (not .cu, not
#                                               the *_gpu_test.cc: clang 14
#                                               refuses their lambdas' captures
#                                               of structured bindings)
# Fails when any check fires (WarningsAsErrors).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
regex=${2:-"^$PWD/(common|kernels|storage|transport|store_node|worker|coordinator|tests)/(?!.*_gpu_test\\.cc\$).*\\.cc\$"}
[ -f "$build/compile_commands.json" ] || { echo "tidy: $build/compile_commands.json missing (configure first)" >&2; exit 2; }
run-clang-tidy -p "$build" -j"$(nproc)" -quiet "$regex"
