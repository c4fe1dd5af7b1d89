#!/usr/bin/env bash
# Formats the C++/CUDA sources with the tree's .clang-format (clang-format 14,
# Debian's `clang-format`, installed by ops/setup.sh).
#   bash ops/format.sh            format every tracked source in place
#   bash ops/format.sh --check    change nothing; fail naming the files that
#                                 differ (CI runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -d '' files < <(git ls-files -z -- '*.h' '*.cc' '*.cu' '*.cuh' 2>/dev/null ||
                        find common kernels storage transport store_node worker coordinator tests \
                          \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) -print0)
if [ "${1:-}" = "--check" ]; then
  clang-format --dry-run -Werror "${files[@]}"
  echo "format: ${#files[@]} files match .clang-format"
else
  clang-format -i "${files[@]}"
fi
