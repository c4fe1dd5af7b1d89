#!/usr/bin/env bash
# Builds the training/held-out text corpus for the evaluation model (issue 4)
# from Debian packages. Runs on the development machine (root, Debian
# bookworm), not on the GPU machine. Output (git-ignored, carried to the GPU
# machine): $OUT_DIR/corpus-train.txt.xz, corpus-heldout.txt.xz, sources.json.
#
# Usage: ops/evalmodel/prepare_corpus.sh [OUT_DIR]
#   (default: build-evalmodel/data, git-ignored through /build*/)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT_DIR="${1:-$ROOT/build-evalmodel/data}"

PACKAGES=(
  bible-kjv-text bible-kjv
  fortunes fortunes-min fortunes-bofh-excuses
  jargon-text
  linux-doc-6.1
  python3.11-doc
  perl-doc
  postgresql-doc-15
  git-doc
  debian-handbook
  gnu-standards
  bash-doc
  doc-debian
  dict-gcide
)

if [[ "${SKIP_APT:-0}" != "1" ]]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
fi

mkdir -p "$OUT_DIR"
python3 "$ROOT/ops/evalmodel/extract_corpus.py" --out "$OUT_DIR"
ls -l "$OUT_DIR"
