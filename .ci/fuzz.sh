#!/usr/bin/env bash
# Builds the safetensors parser fuzzer with clang (libFuzzer + ASan + UBSan)
# and runs it for a fixed time from a small generated seed corpus.
#   .ci/fuzz.sh [seconds]        default 60
# Env: FUZZ_WORK (scratch dir; default a fresh mktemp dir, removed on exit).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_TO_RUN="${1:-60}"
CXX="${CXX_FUZZ:-clang++}"
if [[ -n "${FUZZ_WORK:-}" ]]; then
  WORK="$FUZZ_WORK"
  mkdir -p "$WORK"
else
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
fi

echo "== building safetensors_fuzz with $CXX"
"$CXX" -std=c++20 -O1 -g -fno-omit-frame-pointer \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$ROOT" \
  "$ROOT/worker/model/fuzz/safetensors_fuzz.cc" \
  "$ROOT/worker/model/safetensors.cc" \
  "$ROOT/common/status.cc" "$ROOT/common/dtype.cc" "$ROOT/common/file.cc" \
  -lglog -o "$WORK/safetensors_fuzz"

echo "== generating seed corpus"
mkdir -p "$WORK/corpus"
python3 - "$WORK/corpus" <<'PY'
import json, struct, sys, os
out = sys.argv[1]

def write(name, tensors, metadata=None, pad=True):
    header, body = {}, b""
    for tname, dtype, shape, data in tensors:
        header[tname] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(data)]}
        body += data
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * ((8 - (8 + len(h)) % 8) % 8)
    with open(os.path.join(out, name), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + body)

f32 = lambda *v: struct.pack("<%df" % len(v), *v)
write("empty", [])
write("one_f32", [("w", "F32", [2, 2], f32(1, 2, 3, 4))], {"format": "pt"})
write("mixed", [("model.embed_tokens.weight", "BF16", [4, 2], bytes(range(16))),
                ("model.norm.weight", "F16", [2], b"\x00\x3c\x00\x3c"),
                ("ids", "I32", [3], struct.pack("<3i", 1, 2, 3)),
                ("q", "I8", [4], b"\x01\x02\x03\x04"),
                ("s", "F32", [], f32(7)),
                ("z", "F32", [0, 3], b"")], {"format": "pt", "k": "v"}, pad=False)
write("i64_f64", [("a", "I64", [1], struct.pack("<q", 5)), ("b", "F64", [1], struct.pack("<d", 1.5))])
PY
ls -l "$WORK/corpus"

echo "== fuzzing for ${SECONDS_TO_RUN}s"
# Writes any crashing input to $WORK/crash-*; a finding makes the run fail.
"$WORK/safetensors_fuzz" -max_total_time="$SECONDS_TO_RUN" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$WORK/" "$WORK/corpus"
echo "== fuzz: no findings"
