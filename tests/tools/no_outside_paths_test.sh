#!/usr/bin/env bash
# Nothing the build, the tests or the main command use reads outside the
# repository: no source, build or script file names ../shared (the developers'
# reference folder) or /work. GPU benchmark tools (ops/device/) are developer
# tools and may; prose (*.md) and recorded results are not read at run time.
# .ci/run proves the same by testing a copy with nothing beside it.
set -u
cd "${1:-.}"
hits=$(find . \( -path ./build -o -path './build-*' -o -path ./.git -o -path ./.device -o -path ./ops/device \
                 -o -path ./bench/results -o -path ./docs \) -prune -o -type f \
            \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.py' -o -name '*.sh' \
               -o -name 'CMakeLists.txt' -o -name '*.cmake' -o -name '*.yaml' -o -path './.ci/*' \) \
            ! -name no_outside_paths_test.sh -print0 |
       xargs -0 grep -nE '\.\./shared|/work/(shared|main)' 2>/dev/null)
if [ -n "$hits" ]; then
  echo "files that read outside the repository:"
  echo "$hits"
  exit 1
fi
echo "no_outside_paths_test: no source, build or script file reads outside the repository"
