#!/usr/bin/env bash
# `penumbra generate` range-checks every sampling flag: each bad value exits
# non-zero with one message naming the flag and its range; good values run.
#   tests/tools/cli_flags_test.sh PATH/TO/penumbra   (from the repository root)
set -u
BIN=${1:?usage: cli_flags_test.sh PENUMBRA_BINARY}
MODEL=tests/data/models/stories260K
[ -f "$MODEL/model.safetensors" ] || { echo "test data missing: $MODEL/model.safetensors"; exit 1; }
fail=0
expect_refused() {  # expect_refused SUBSTRING ARGS...
  local want=$1; shift
  local out rc
  out=$("$BIN" generate --model "$MODEL" --prompt-ids 1 "$@" 2>&1); rc=$?
  if [ $rc -eq 0 ] || ! grep -qF -- "$want" <<<"$out"; then
    echo "FAIL: $* -> rc=$rc, want an error containing '$want'; got: $out"; fail=1
  else
    echo "ok: $* -> $(head -1 <<<"$out")"
  fi
}
expect_refused "--temperature: must be in [0, 100], got -1" --temperature -1
expect_refused "--temperature: must be in [0, 100], got nan" --temperature nan
expect_refused "--temperature: must be in [0, 100], got 1e9" --temperature 1e9
expect_refused "--top-p: must be in (0, 1], got 2" --temperature 0.7 --top-p 2
expect_refused "--top-p: must be in (0, 1], got 0" --temperature 0.7 --top-p 0
expect_refused "--top-k: must be in [0, 2147483647], got -3" --temperature 0.7 --top-k -3
expect_refused "--max-new-tokens: must be in [1, 1073741824], got 1000000000000" --max-new-tokens 1000000000000
expect_refused "--max-new-tokens: must be in [1, 1073741824], got 0" --max-new-tokens 0
expect_refused "--seed: must be in [0, 9223372036854775807], got -1" --temperature 0.7 --seed -1
expect_refused "--stop-ids: id -5 is out of range" --stop-ids -5
expect_refused "stop id 600 is outside the vocabulary [0, 512)" --stop-ids 600
expect_refused "exceeds the model's 512-token context" --max-new-tokens 100000
out=$("$BIN" generate --model "$MODEL" --prompt-ids 1 --max-new-tokens 4 --temperature 0.8 --top-k 40 --top-p 0.9 --seed 7 --json 2>&1)
if [ $? -ne 0 ] || ! grep -q '"generated_tokens":4' <<<"$out"; then echo "FAIL: good sampling flags: $out"; fail=1; else echo "ok: good sampling flags run"; fi
[ $fail -eq 0 ] && echo "cli_flags_test: all passed"
exit $fail
