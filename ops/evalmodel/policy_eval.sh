#!/usr/bin/env bash
# Accuracy of KV policies on the first evaluation model (models/penumbra-eval)
# at long lengths, on the GPU machine. The bundle (penumbra) and the model
# together exceed one device call's upload, so it takes two calls on one held
# machine (build-evalmodel/ is ignored by git: what call 1 leaves there stays
# while the machine is held, about 30 s idle):
#
#   call 1  carry [".device"], models/penumbra-eval moved aside for the upload:
#             bash ops/evalmodel/policy_eval.sh stage
#           copies the bundle to build-evalmodel/dev.
#   call 2  no carry, the model back in the tree:
#             bash ops/evalmodel/policy_eval.sh run
#           makes the task sets at LENGTHS (default "16384 32768"; 25 records
#           per task, seed 5151, the haystack tests/data/evaltasks/haystack_kjv.txt,
#           which no model trained on), then runs `penumbra eval` once per
#           '|'-separated flag set of VARIANTS (default: full, shadowkv,
#           specontext with its defaults and with the paper's tokens alone).
#           Each run's summary line, tagged (suite eval-policies, command,
#           commit, GPU), goes to $OUT/eval.jsonl, its per-group lines and
#           predictions to $OUT/eval-N.jsonl and $OUT/predictions-N.jsonl;
#           $OUT/eval.tgz holds them all. TASKS (tasks.py's --tasks; default
#           its default set) picks the tasks: TASKS=kv_many LENGTHS=16384 is
#           the long-generation set (64 values, about 1.5K tokens, written
#           in one answer).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
DEV=build-evalmodel/dev
MODEL=models/penumbra-eval
case "${1:-}" in
  stage)
    [ -f .device/run ] || { echo "policy_eval: no bundle in .device (carry it)"; exit 2; }
    mkdir -p "$DEV" && cp -r .device/. "$DEV/" && echo "staged $(du -sh "$DEV" | cut -f1) in $DEV"
    ;;
  run)
    [ -f "$DEV/run" ] || { echo "policy_eval: $DEV is empty (call 1: stage)"; exit 2; }
    [ -f "$MODEL/config.json" ] || { echo "policy_eval: $MODEL is not here"; exit 2; }
    export PENUMBRA_COMMIT=$(cat "$DEV/COMMIT" 2>/dev/null || echo unknown)
    LENGTHS=${LENGTHS:-"16384 32768"}
    VARIANTS=${VARIANTS:-"--kv-policy full|--kv-policy shadowkv|--kv-policy specontext|--kv-policy specontext --specontext-successors 0 --specontext-local 32"}
    tasks=""
    for L in $LENGTHS; do
      f=build-evalmodel/tasks-${TASKS:-default}-$L.jsonl
      [ -s "$f" ] || timeout 300 python3 ops/evalmodel/tasks.py --corpus tests/data/evaltasks/haystack_kjv.txt \
        --tokenizer $MODEL/tokenizer.json --lengths "$L" --num 25 --seed 5151 ${TASKS:+--tasks "$TASKS"} \
        --out "$f" >> "$OUT/tasks.log" 2>&1
      [ -s "$f" ] || { echo "policy_eval: no task set at $L (see tasks.log)"; exit 1; }
      tasks="$tasks $f"
    done
    cat $tasks > build-evalmodel/tasks-all.jsonl
    n=0
    IFS_OLD=$IFS
    IFS='|'
    for v in $VARIANTS; do
      IFS=$IFS_OLD
      n=$((n + 1))
      cmd="penumbra eval --model $MODEL --tasks tasks(${TASKS:-default}; ${LENGTHS// /,}; 25 records, seed 5151).jsonl $v --json"
      # shellcheck disable=SC2086
      timeout "${EVAL_TIMEOUT:-900}" bash "$DEV/run" penumbra eval --model $MODEL --tasks build-evalmodel/tasks-all.jsonl \
        $v --json --predictions "$OUT/predictions-$n.jsonl" > "$OUT/eval-$n.jsonl" 2> "$OUT/eval-$n.err"
      echo "variant $n ($v): rc=$?"
      grep '"summary"' "$OUT/eval-$n.jsonl" | python3 bench/record.py tag --suite eval-policies --command "$cmd" |
        tee -a "$OUT/eval.jsonl"
    done
    IFS=$IFS_OLD
    tar czf "$OUT/eval.tgz" -C "$OUT" $(cd "$OUT" && ls eval-*.jsonl predictions-*.jsonl tasks.log 2>/dev/null)
    ;;
  *)
    sed -n '2,24p' "$0"
    exit 2
    ;;
esac
