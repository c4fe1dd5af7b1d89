#!/usr/bin/env bash
# Installs every Debian package the Penumbra build and tests need. Idempotent:
# packages already present are skipped, so a second run costs a few seconds.
set -euo pipefail
pkgs=(
  build-essential cmake ninja-build pkg-config
  libopenblas-dev liblapacke-dev
  libgoogle-glog-dev libgflags-dev
  libgtest-dev libgmock-dev
  libyaml-cpp-dev nlohmann-json3-dev
  libpcre2-dev libxxhash-dev libutf8proc-dev
  librocksdb-dev libssl-dev
  thrift-compiler libthrift-dev libboost-dev python3-thrift libcpp-httplib-dev prometheus-cpp-dev
  libucx-dev
  clang libclang-rt-14-dev clang-format clang-tidy  # fuzzers; the format and lint checks
  python3
  iproute2  # ip and ss: the multihost test's network namespaces (tests/multihost)
  jq  # the batch example of docs/openai.md (the openai_docs_curl test)
  prometheus  # the scrape test (CTest label prometheus) runs Debian's server on loopback
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if [ ! -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  echo "setup: nvcc not found; building the CPU backend only" >&2
fi
# The official OpenAI client for the OpenAI-compatible API's tests (CTest
# label openai), pinned by tests/openai/client/package-lock.json. Node.js
# from Debian where the machine has none.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends nodejs npm
fi
client=tests/openai/client
if ! cmp -s "$client/package-lock.json" "$client/node_modules/.penumbra-installed-lock" 2>/dev/null; then
  (cd "$client" && npm ci --no-audit --no-fund --loglevel=error &&
     cp package-lock.json node_modules/.penumbra-installed-lock)
fi
