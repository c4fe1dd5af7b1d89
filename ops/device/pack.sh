#!/usr/bin/env bash
# Builds here for sm_90a and packs what ops/device/bench.sh runs into .device/
# (a developer tool: it uses ../shared/tools/device-bundle), with the
# full-attention peer (bench/peer/full_attention_peer.py) and the commit the
# bundle was built from (.device/COMMIT: the device's copy of the tree is not a
# git checkout; bench/record.py tags every row with it):
#
#   bash ops/device/pack.sh [BINARY...]    default: penumbra, penumbra-bench,
#                                          penumbra-shadowkv-check, every *_gpu_test
#
# Then one device call per group of suites, carrying [".device"]:
#   bash ops/device/bench.sh parity check            (correctness)
#   bash ops/device/bench.sh shadowkv full ttft      (throughput beside the peer)
#
# A call uploads the tracked tree plus .device, at most 64 MiB. The tracked
# tree holds the 51 MB evaluation model (models/penumbra-eval), so for any
# call but the eval suite move it aside first and back after:
#   mv models/penumbra-eval /tmp/penumbra-eval.hold   # ... device call ...
#   mv /tmp/penumbra-eval.hold models/penumbra-eval
# (the eval suite needs the model and a bundle of penumbra alone).
set -euo pipefail
cd "$(dirname "$0")/../.."
bundler=../shared/tools/device-bundle
[ -x "$bundler" ] || [ -f "$bundler" ] || { echo "pack.sh: $bundler not found (the developers' shared folder)" >&2; exit 2; }
bash ops/build.sh >/dev/null
if [ $# -gt 0 ]; then
  bins=("$@")
else
  bins=(penumbra penumbra-bench penumbra-shadowkv-check)
  while read -r t; do bins+=("$t"); done < <(ninja -C build -t targets all | sed -n 's|^bin/\([a-z0-9_]*_gpu_test\): .*|\1|p' | sort -u)
fi
stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
for b in "${bins[@]}"; do
  [ -f "build/bin/$b" ] || { echo "pack.sh: build/bin/$b was not built" >&2; exit 2; }
  cp "build/bin/$b" "$stage/" && strip "$stage/$b"
done
mkdir -p .git/info
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
bash "$bundler" .device "$stage"/*
rm -f .device/peer_full_attention.py  # the bundler's own copy of a peer; ours is under bench/peer
cp bench/peer/full_attention_peer.py .device/
# The Python client's generated code and the thrift package (pure Python)
# for ops/loadtest.py (the openai_load suite): the device has no python3-thrift.
rm -rf .device/gen-py .device/pylib && cp -r build/transport/gen-py .device/gen-py && mkdir -p .device/pylib &&
  cp -r /usr/lib/python3/dist-packages/thrift .device/pylib/ && find .device/pylib -name '*.so' -delete &&
  find .device -name __pycache__ -prune -exec rm -rf {} +
git rev-parse HEAD > .device/COMMIT
git diff --quiet HEAD -- . ':!.device' || echo "pack.sh: the tree differs from $(cat .device/COMMIT) (rows will name that commit)" >&2
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
bundle=$(du -sb .device | cut -f1)
echo "pack.sh: tracked tree $((tracked >> 20)) MiB + .device $((bundle >> 20)) MiB (a call uploads at most 64 MiB)"
if [ $((tracked + bundle)) -gt $((64 << 20)) ]; then
  echo "pack.sh: over the limit: move models/penumbra-eval aside for the call (see the top of this script)"
fi
