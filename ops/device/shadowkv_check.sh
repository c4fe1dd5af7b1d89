#!/usr/bin/env bash
# One GPU-machine run of the independent ShadowKV reference check
# (tests/reference/README.md): the reference's self-test, then two synthetic
# inputs sets (the README defaults, and d 64 / hkv 4 / group 2 / S 16384 /
# rank 40 / budget 256 / outliers 6 / W 32), each run through
# penumbra-shadowkv-check on cuda/bf16 and cpu/f32 in every mode (direct: the
# context is the prompt; attached: a document taken, exported, imported and
# attached; cp2: two context-parallel ranks with the global selection) and
# compared with the reference (cp2's results name their shards, so the
# comparator runs the sharded reference; the default set's cp2 runs on
# inputs of the same shapes whose every shard's rank-r cut is well-posed,
# "make-inputs default_cp2"). Logs and the comparator's JSON
# summaries go to $OUT; one "PASS|FAIL name" line per check (per set,
# device, dtype and mode: "compare d64_cuda_bf16_cp2") is printed and
# collected in $OUT/shadowkv_check.txt. Exit status 0 when everything passed.
# Usage (repository root, bundle in .device):
#   ops/device/shadowkv_check.sh [BIN]
# BIN: the penumbra-shadowkv-check binary, or a folder holding it; default:
# the bundled one through "bash .device/run". CHECK_SETS (default
# "default d64") and CHECK_MODES (default "direct attached cp2") pick the
# inputs sets and modes run.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
R=tests/reference
if [ -n "${1:-}" ] && [ -d "$1" ]; then
  TOOL=("$1/penumbra-shadowkv-check")
elif [ -n "${1:-}" ]; then
  TOOL=("$1")
else
  TOOL=(bash .device/run penumbra-shadowkv-check)
fi
WORK=$(mktemp -d /tmp/skvcheck.XXXXXX)
SUMMARY="$OUT/shadowkv_check.txt"
: > "$SUMMARY"
failed=0
report() {  # report NAME RC
  local v=PASS; [ "$2" -eq 0 ] || { v=FAIL; failed=1; }
  echo "$v $1 (rc=$2)" | tee -a "$SUMMARY"
}

timeout 600 python3 $R/shadowkv_reference.py self-test > "$OUT/selftest.log" 2>&1
report self-test $?; tail -3 "$OUT/selftest.log"

# name, make-inputs flags, and the flags cp2's own inputs add ("": cp2 uses
# the set's inputs). cp2 factors each shard alone, so its rank-r cut must be
# well-posed in every shard (tests/reference/README.md, "Conditioning of the
# rank-r cut"): the default set's shards of 4096 tokens cut at rank 160 where
# an f32 factorization cannot pin the rank-160 subspace down, so cp2 takes
# the same shapes with keys whose shards each span fewer than 160 directions
# above a 1e-5 noise floor (their own subspace per shard).
sets=(
  "default|--seq 8192 --hkv 8 --group 4 --d 128 --rank 160 --chunk 8 --budget 2048 --outliers 48 --local-window 32 --steps 8|--latent 144 --decay 160 --noise 1e-5 --segments 0,4096,8192 --shards 0,4096,8192"
  "d64|--seq 16384 --hkv 4 --group 2 --d 64 --rank 40 --chunk 8 --budget 256 --outliers 6 --local-window 32 --steps 8|"
)
make_inputs() {  # make_inputs NAME FILE FLAGS...; 0 when made
  local name=$1 file=$2; shift 2
  timeout 600 python3 $R/shadowkv_reference.py make-inputs --out "$file" --seed 1 "$@" > "$OUT/make_$name.log" 2>&1
  local rc=$?; report "make-inputs $name" $rc; cat "$OUT/make_$name.log"
  return $rc
}
for s in "${sets[@]}"; do
  name=${s%%|*}; rest=${s#*|}; flags=${rest%%|*}; cp2flags=${rest#*|}
  [[ " ${CHECK_SETS:-default d64} " == *" $name "* ]] || continue
  in="$WORK/in_$name.safetensors"
  # shellcheck disable=SC2086
  make_inputs "$name" "$in" $flags || continue
  in_cp2=$in
  if [ -n "$cp2flags" ] && [[ " ${CHECK_MODES:-direct attached cp2} " == *" cp2 "* ]]; then
    in_cp2="$WORK/in_${name}_cp2.safetensors"
    # shellcheck disable=SC2086
    make_inputs "${name}_cp2" "$in_cp2" $flags $cp2flags || in_cp2=
  fi
  for devdt in cuda:bf16 cpu:f32; do
    dev=${devdt%%:*}; dt=${devdt#*:}
    for mode in ${CHECK_MODES:-direct attached cp2}; do
      tag="${name}_${dev}_${dt}_${mode}"
      in_mode=$in; [ "$mode" = cp2 ] && in_mode=$in_cp2
      [ -n "$in_mode" ] || continue
      ours="$WORK/ours_$tag.safetensors"
      timeout 600 "${TOOL[@]}" --in "$in_mode" --out "$ours" --device "$dev" --dtype "$dt" --mode "$mode" \
        > "$OUT/tool_$tag.log" 2>&1
      rc=$?; report "penumbra-shadowkv-check $tag" $rc; tail -2 "$OUT/tool_$tag.log"
      [ $rc -eq 0 ] || continue
      tol=(); [ "$dt" = bf16 ] && tol=(--tol-bf16)
      timeout 900 python3 $R/compare_shadowkv.py --inputs "$in_mode" --ours "$ours" "${tol[@]}" \
        --json "$OUT/summary_$tag.json" > "$OUT/compare_$tag.log" 2>&1
      rc=$?; report "compare $tag" $rc; cat "$OUT/compare_$tag.log"
    done
  done
done
rm -rf "$WORK"
echo "== summary"; cat "$SUMMARY"
exit $failed
