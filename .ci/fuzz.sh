#!/usr/bin/env bash
# Builds every libFuzzer target of the tree (penumbra_fuzzer() in CMake: the
# parsers an attacker or a bad file reaches — safetensors, the public API's
# and the control API's requests, the store node's messages) with clang,
# libFuzzer, ASan and UBSan, and runs each for a fixed time from its seed
# corpus. Any finding (a crash, a sanitizer report, a leak, a timeout) fails
# the run; the input is kept in the work folder.
#   .ci/fuzz.sh [seconds per fuzzer]     default 30
# Env: FUZZ_WORK (corpora and findings; default build/fuzz/work, emptied
# first), FUZZ_BUILD (the clang build; default build/fuzz, kept: incremental),
# FUZZ_ONLY (run only these fuzzers, space-separated).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_TO_RUN="${1:-30}"
BUILD="${FUZZ_BUILD:-$ROOT/build/fuzz}"
WORK="${FUZZ_WORK:-$BUILD/work}"
rm -rf "$WORK"
mkdir -p "$WORK"

echo "== building the fuzzers with clang (log: $BUILD/build.log)"
mkdir -p "$BUILD"
if ! { cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
         -DPENUMBRA_FUZZ=ON -DPENUMBRA_CUDA=OFF -DPENUMBRA_SANITIZE="address;undefined" \
         -DCMAKE_CXX_FLAGS="-fno-sanitize-recover=undefined" &&
       ninja -C "$BUILD" -j"$(nproc)" fuzzers; } > "$BUILD/build.log" 2>&1; then
  tail -50 "$BUILD/build.log"
  echo "== fuzz: the build failed"
  exit 1
fi

# Seeds of the safetensors parser: small valid files of every dtype.
mkdir -p "$WORK/corpus/safetensors_fuzz"
python3 - "$WORK/corpus/safetensors_fuzz" <<'PY'
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

# One fuzzer: its seeds, then SECONDS_TO_RUN of fuzzing; what it prints goes
# to $WORK/findings/NAME/summary (printed in order once all have run) and its
# status to .../status.
fuzz_one() {
  local bin=$1 name corpus out
  name="$(basename "$bin")"
  corpus="$WORK/corpus/$name"
  out="$WORK/findings/$name"
  mkdir -p "$corpus" "$out"
  if [[ -d "$ROOT/tests/fuzz/$name" ]]; then cp "$ROOT/tests/fuzz/$name"/* "$corpus/" 2>/dev/null || true; fi
  # A fuzzer may write seeds of its own (valid messages made by our code).
  PENUMBRA_FUZZ_SEEDS="$corpus" "$bin" -runs=0 "$corpus" > "$out/seeds.log" 2>&1 || true
  {
    echo "== fuzzing $name for ${SECONDS_TO_RUN}s ($(ls "$corpus" | wc -l) seeds)"
    if ! "$bin" -max_total_time="$SECONDS_TO_RUN" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
         -print_final_stats=1 -artifact_prefix="$out/" "$corpus" > "$out/fuzz.log" 2>&1; then
      tail -60 "$out/fuzz.log"
      echo "== fuzz: $name found a failure (inputs: $out/)"
      echo 1 > "$out/status"
    else
      grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb" "$out/fuzz.log" | tr '\n' ' '
      echo
      echo 0 > "$out/status"
    fi
  } > "$out/summary" 2>&1
}

# The fuzzers run side by side, one per core (libFuzzer is single-threaded:
# each still gets SECONDS_TO_RUN of a core).
names=()
for bin in "$BUILD"/bin/*_fuzz; do
  name="$(basename "$bin")"
  if [[ -n "${FUZZ_ONLY:-}" && " $FUZZ_ONLY " != *" $name "* ]]; then continue; fi
  names+=("$name")
  while [[ $(jobs -rp | wc -l) -ge $(nproc) ]]; do wait -n || true; done
  fuzz_one "$bin" &
done
wait
status=0
for name in "${names[@]}"; do
  cat "$WORK/findings/$name/summary"
  [[ "$(cat "$WORK/findings/$name/status" 2>/dev/null)" == 0 ]] || status=1
done
[[ $status -eq 0 ]] && echo "== fuzz: no findings"
exit $status
