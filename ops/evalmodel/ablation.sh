#!/usr/bin/env bash
# Issue 20's accuracy comparisons on the GPU machine: one task set, made here
# from a seed and the held-out KJV haystack (which no model trained on) with
# the model's tokenizer, then `penumbra eval` under each configuration, one
# summary line each.
#
# Usage (device call from the repository root, the bundle in .device, the
# model in the tree; tests/data/models may be moved aside for the upload):
#   MODEL=models/penumbra-eval \
#   TASKS="--tasks kv,niah_multivalue,cwe --lengths 16384 --num 25 --seed 5151" \
#   CONFIGS="full|shadowkv|shadowkv --landmarks-per-chunk 2" \
#   bash ops/evalmodel/ablation.sh
#
# CONFIGS: '|'-separated; each is a KV policy and its flags. Out ($OUT):
# summaries.jsonl (each config's summary line, with "flags", "command",
# "tasks_made_by" and "tasks_sha256"), preds.tgz (every config's predictions,
# pred<N>.jsonl in CONFIGS order), eval.log; each summary is penumbra eval's
# (with "per_task", every task's accuracy in %). The same TASKS give
# the same records (tasks.py is deterministic), so two calls compare. A call
# brings back at most 8 files: give each run of this script in one call its
# own folder under $OUT (OUT=$OUT/a ...), at most two runs per call.
#
# Runs longer than a call's 600 s (a 64K set: about 450 s with three runs
# sharing the GPU) start in their own session so that they outlive the call,
# with OUT and WORK under build-ablation/ (the machine empties $OUT before
# each call), and a later call on the same held machine collects them:
#   (setsid nohup env CONFIGS="shadowkv --rank 512" WORK=build-ablation/wa \
#      OUT=build-ablation/oa ... bash ops/evalmodel/ablation.sh \
#      > build-ablation/a.log 2>&1 < /dev/null &)
# The machine goes back 30 s after a call ends with none in flight: chain
# the calls (a waiting call: poll build-ablation/o*/eval.log for "done").
#
# More records for a set already run (a smaller standard error): records
# 25..99 of the 100-record set in three pieces run side by side, e.g.
#   TASKS="--lengths 64000 --num 50 --first 25 --seed 5151", then --num 75
#   --first 50, then --num 100 --first 75 (tasks.py: a record depends only on
#   its seed, task, length and index), and the pieces' prediction files
#   with the first 25's are the 100-record run: compare_predictions.py reads
#   a comma-separated list of files as their concatenation, e.g.
#   compare_predictions.py full-0.jsonl,full-25.jsonl,... skv-0.jsonl,...).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
MODEL=${MODEL:-models/penumbra-eval}
TASKS=${TASKS:---tasks kv,niah_multivalue,cwe --lengths 16384 --num 25 --seed 5151}
CONFIGS=${CONFIGS-full|shadowkv}     # unset: these two; empty (CONFIGS=""): only make the task set
HAYSTACK=tests/data/evaltasks/haystack_kjv.txt
WORK=${WORK:-build-ablation}           # one per concurrent run of this script
mkdir -p $WORK
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/eval.log"; }

[ -f "$MODEL/config.json" ] || { log "no model at $MODEL (moved aside for the upload?)"; exit 2; }
gen="ops/evalmodel/tasks.py --corpus $HAYSTACK --tokenizer $MODEL/tokenizer.json $TASKS"
key=$(echo "$gen" | sha256sum | cut -c1-16)
mkdir -p build-ablation
tasks=build-ablation/tasks-$key.jsonl   # shared by concurrent runs (CONFIGS="" only makes it)
if [ ! -f "$tasks" ]; then
  python3 $gen --jobs 12 --out "$tasks.tmp" >>"$OUT/eval.log" 2>&1 && mv "$tasks.tmp" "$tasks" ||
    { log "task generation failed: $gen"; exit 2; }
fi
sha=$(sha256sum "$tasks" | cut -d' ' -f1)
log "tasks: $gen -> $(wc -l < "$tasks") records, sha256 $sha"

# The bundle unpacks itself on first use (.device/run: into a fixed
# temporary name, then renamed); concurrent first uses collide, so unpack it
# once under a lock before any config runs.
lock=(); command -v flock >/dev/null && lock=(flock build-ablation/.unpack)
"${lock[@]}" bash .device/run penumbra --help >/dev/null 2>&1 ||
  { log "the bundle does not run (bash .device/run penumbra --help)"; exit 2; }

rm -f $WORK/pred*.jsonl
i=0
IFS='|' read -ra configs <<< "$CONFIGS"
for c in "${configs[@]}"; do
  i=$((i + 1))
  read -r policy flags <<< "$c"
  cmd="penumbra eval --model $MODEL --tasks $tasks --device cuda --json --kv-policy $policy $flags --predictions $WORK/pred$i.jsonl"
  log "config $i: $c"
  bash .device/run $cmd > "$WORK/eval$i.log" 2>>"$OUT/eval.log"
  rc=$?
  tail -1 "$WORK/eval$i.log" | FLAGS="$c" CMD="$cmd" GEN="$gen" SHA="$sha" PRED="pred$i.jsonl" RC=$rc python3 -c '
import json, os, sys
line = sys.stdin.read().strip()
try:
    j = json.loads(line)
except ValueError:
    j = {"error": "no summary line", "rc": int(os.environ["RC"])}
j.update(flags=os.environ["FLAGS"], command=os.environ["CMD"], tasks_made_by=os.environ["GEN"],
         tasks_sha256=os.environ["SHA"], predictions=os.environ["PRED"])
print(json.dumps(j))' | tee -a "$OUT/summaries.jsonl" | python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
pt = j.get("per_task", {})
parts = ["%s=%s" % (t, v) for t, v in sorted(pt.items())]
print("  accuracy", j.get("accuracy"), " ".join(parts), "hit_rate", j.get("hit_rate"))' | tee -a "$OUT/eval.log"
  # After every config, so a call that runs out of time keeps what finished.
  tar -C $WORK -czf "$OUT/preds.tgz" $(cd $WORK && ls pred*.jsonl 2>/dev/null)
done
log "done"
