#!/usr/bin/env bash
# The GPU-machine side of issue 20's second evaluation model (train.py
# --preset paper: 8 KV heads x 128, GQA 4, ~109M parameters, to 32K),
# trained over several device sessions.
#
# Within one session the machine stays warm between calls and build-paper/run
# (ignored by git) keeps the whole state (weights, optimizer, schedule): each
# `train` call continues exactly. Across sessions only the exported bf16
# weights travel (a call brings back at most 64 MiB, 16 MiB a file, 8 files;
# the ~220 MB of weights take four calls each way), and the next session
# continues from them with fresh optimizer moments (train.py --init-from).
#
# Device calls (run from the repository root, the first model moved aside:
# the upload is capped at 64 MiB):
#   train    carry ["build-paper/in"]: build-paper/in/corpus-train.txt.xz and
#            build-paper/in/tokenizer.json (the first model's: both models
#            read the same task sets). Trains until CALL_S seconds are used. Where
#            build-paper/init holds a previous session's export and there is
#            no state yet, starts from it.
#   get N    (after the session's last train call, which exports) copies the
#            export's files N*4 .. N*4+3 (sorted; the shards, then the small
#            files in one tar) to $OUT, a file over 16 MB in pieces
#            (NAME.partNN); repeat for N = 0, 1, ... until it says the last
#            part. Here: join the pieces (cat NAME.part* > NAME), untar
#            meta.tgz, keep the directory beside the repository (not in it:
#            ~210 MB), e.g. /work/paper-ckpt/model.
#   merge    the uploaded parts into build-paper/init/model (for ablation.sh).
#   card LEN [bf16|f32]  (the bundle with penumbra in .device, the model
#            staged or MODEL=DIR) transformers vs `penumbra eval` under full
#            attention on one task set; $OUT/card-LEN-DTYPE.tgz.
#   stage DIR  (here, in a later session) splits that directory into
#            build-paper/init/part0, part1, ... of at most PART_BYTES (40 MB;
#            the tracked tree, without the first model and with
#            tests/data/models moved aside too, is 10 MB: 50 MB parts fit). Carry
#            ["build-paper/init/partK"] in one call each (command `true`; the
#            parts stay on the warm machine), then `train` starts from them
#            (train.py --init-from: fresh optimizer moments, the LR re-warmed).
#   stage-xz DIR  (here) the same as one xz archive in pieces: three calls
#            instead of five for the 210 MB model (see the case below).
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
E=ops/evalmodel
D=build-paper
RUN=$D/run
CALL_S=${CALL_S:-570}                  # this call's wall budget (the device limit is 600 s)
TRAIN_MINUTES=${TRAIN_MINUTES:-45}     # the whole training, over every session
mkdir -p "$RUN" "$D/logs"
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

merge_init() {  # build-paper/up (stage-xz) or build-paper/init/part*/* -> build-paper/init/model
  if ls $D/up/q*/m.xz.* >/dev/null 2>&1; then
    mkdir -p $D/init/model $D/x
    cat $(ls $D/up/q*/m.xz.* | sort -t. -k3 -n) |
      python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('$D/x')" ||
      { log "build-paper/up: the pieces do not make one archive (one missing?)"; exit 2; }
    cp $D/x/*/* $D/init/model/ && rm -rf $D/x
  fi
  [ -d $D/init ] || return 0
  mkdir -p $D/init/model
  for p in $D/init/part*; do [ -d "$p" ] && cp "$p"/* $D/init/model/; done
  for f in $D/init/model/*.part00; do  # files that travelled in pieces
    [ -e "$f" ] || continue
    cat "${f%.part00}".part* > "${f%.part00}" && rm "${f%.part00}".part*
  done
  if [ -f $D/init/model/meta.tgz ]; then tar -C $D/init/model -xzf $D/init/model/meta.tgz; fi
  ls -la $D/init/model
  [ -f $D/init/model/training_state.json ] || { log "build-paper/init: no training_state.json"; exit 2; }
}

case "${1:-}" in
  train)
    INIT=()
    if [ ! -f $RUN/state.pt ] && [ -d $D/init ]; then
      merge_init
      INIT=(--init-from $D/init/model)
    fi
    left=$(python3 -c "print(max(1.0, ($CALL_S - ($(date +%s) - $T0)) / 60))")
    log "train for $left min"
    python3 $E/train.py --preset paper --corpus $D/in/corpus-train.txt.xz --tokenizer $D/in/tokenizer.json \
      --out $RUN --auto-minutes "$TRAIN_MINUTES" --max-minutes "$left" --workers 14 --export-at-deadline \
      "${INIT[@]}" 2>&1 | tee -a $D/logs/train.log
    cp $RUN/loss.csv "$OUT/" 2>/dev/null
    ls -la $RUN/model 2>/dev/null
    ;;
  get)
    N=${2:?part number}
    M=$RUN/model
    tar -C $M -czf $D/meta.tgz $(cd $M && ls | grep -v '\.safetensors$')
    mapfile -t files < <( (ls $M/*.safetensors; echo $D/meta.tgz) | sort )
    for ((i = N * 4; i < N * 4 + 4 && i < ${#files[@]}; ++i)); do cp "${files[$i]}" "$OUT/"; done
    # A file over the 16 MiB a file that comes back (the embedding shard is
    # 16 MiB + 136 bytes) travels in pieces: cat NAME.part* > NAME.
    for f in "$OUT"/*; do
      if [ "$(stat -c %s "$f")" -gt 16000000 ]; then split -b 15000000 -d "$f" "$f.part" && rm "$f"; fi
    done
    log "part $N of $(( (${#files[@]} + 3) / 4 )): $(ls $OUT | tr '\n' ' ')"
    ;;
  merge)
    # The staged parts into build-paper/init/model (train and card do it on
    # first use; ablation.sh needs it done: MODEL=build-paper/init/model).
    merge_init
    ;;
  card)
    # The model card's parity: Hugging Face transformers (the independent
    # reference) and `penumbra eval` under full attention, at one dtype, on
    # one task set (every task, 25 records, seed 5151, the held-out KJV
    # haystack: the set ablation.sh makes for the same length). Needs the
    # bundle in .device and the model (MODEL, default the staged export,
    # merged on first use). Out: $OUT/card-LEN-DTYPE.tgz (both prediction
    # files, both summaries, compare_predictions.py's agreement, logs).
    LEN=${2:?length}; DT=${3:-bf16}
    case $DT in bf16) HFDT=bfloat16 ;; f32) HFDT=float32 ;; *) echo "dtype: bf16 or f32" >&2; exit 2 ;; esac
    M=${MODEL:-$D/init/model}
    if [ ! -f "$M/config.json" ] && [ "$M" = $D/init/model ]; then merge_init >/dev/null; fi
    [ -f "$M/config.json" ] || { log "no model at $M"; exit 2; }
    W=$D/card-$LEN-$DT
    rm -rf "$W"; mkdir -p "$W"
    gen="$E/tasks.py --corpus tests/data/evaltasks/haystack_kjv.txt --tokenizer $M/tokenizer.json --lengths $LEN --num 25 --seed 5151"
    python3 $gen --jobs 12 --out "$W/tasks.jsonl" > "$W/tasks.log" 2>&1 || { log "task generation failed"; exit 2; }
    echo "$gen" > "$W/tasks_made_by.txt"; sha256sum "$W/tasks.jsonl" >> "$W/tasks_made_by.txt"
    python3 $E/eval_hf.py --model "$M" --tasks "$W/tasks.jsonl" --dtype $HFDT \
      --predictions "$W/pred_hf.jsonl" > "$W/hf.jsonl" 2> "$W/hf.log" &
    bash .device/run penumbra eval --model "$M" --tasks "$W/tasks.jsonl" --device cuda --dtype $DT --json \
      --kv-policy full --predictions "$W/pred_ours.jsonl" > "$W/ours.jsonl" 2> "$W/ours.log" &
    wait
    python3 $E/compare_predictions.py "$W/pred_hf.jsonl" "$W/pred_ours.jsonl" > "$W/agreement.jsonl" 2>&1
    log "card $LEN $DT: HF $(tail -1 "$W/hf.jsonl" | cut -c1-200)"
    log "card $LEN $DT: ours $(tail -1 "$W/ours.jsonl" | cut -c1-200)"
    log "card $LEN $DT: agreement $(tail -1 "$W/agreement.jsonl")"
    tar -C $D -czf "$OUT/card-$LEN-$DT.tgz" "card-$LEN-$DT"
    ;;
  stage)
    SRC=${2:?exported model directory}
    rm -rf $D/init
    k=0; used=0
    mkdir -p $D/init/part0
    for f in "$SRC"/*; do
      n=$(stat -c %s "$f")
      if [ $used -gt 0 ] && [ $((used + n)) -gt "${PART_BYTES:-40000000}" ]; then k=$((k + 1)); used=0; mkdir -p $D/init/part$k; fi
      cp "$f" $D/init/part$k/
      used=$((used + n))
    done
    du -sh $D/init/part*
    ;;
  stage-xz)
    # Fewer calls than stage: one xz archive of the directory (about 73% of
    # its bytes) in pieces of PART_BYTES under build-paper/up/q1, q2, ...,
    # and its tokenizer.json and config.json in build-paper/up/q0, small
    # enough to travel with the bundle (the first call can make the task
    # sets: ablation.sh CONFIGS="" with MODEL=build-paper/init/model after
    # copying q0 there). With the tracked tree at 12 MB (the first model and
    # the tiny test models moved aside), 51.5 MB pieces fit: the 210 MB model
    # takes three calls. merge joins and unpacks them.
    SRC=${2:?exported model directory}
    rm -rf $D/up && mkdir -p $D/up/q0
    cp "$SRC"/tokenizer.json "$SRC"/config.json $D/up/q0/
    tar -C "$(dirname "$SRC")" -cf - "$(basename "$SRC")" | xz -T0 -6 |
      split -b "${PART_BYTES:-51500000}" -d -a 2 - $D/up/m.xz.
    k=1
    for f in $(ls $D/up/m.xz.* | sort -t. -k3 -n); do mkdir -p $D/up/q$k && mv "$f" $D/up/q$k/; k=$((k + 1)); done
    du -sh $D/up/q*
    ;;
  *)
    echo "usage: $0 train|get N|merge|card LEN [bf16|f32]|stage DIR|stage-xz DIR" >&2
    exit 2
    ;;
esac
