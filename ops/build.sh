#!/usr/bin/env bash
# Configures and builds Penumbra into build/ (Release with debug info, CUDA
# for sm_90a when nvcc is present, warnings as errors when CI=true).
set -euo pipefail
cd "$(dirname "$0")/.."
werror=OFF; [ "${CI:-}" = "true" ] && werror=ON
cmake -S . -B build -G Ninja -DPENUMBRA_WERROR=$werror >/dev/null
ninja -C build -j"$(nproc)" "$@"
