#!/usr/bin/env bash
# The GPU machine's one entry point for parity checks and benchmarks, run from
# the repository root there with the bundle in .device (made here by
# ops/device/pack.sh; the device call carries [".device"]):
#
#   bash ops/device/bench.sh SUITE [SUITE...]
#
# Suites (see `bash ops/device/bench.sh help`): parity, check, full, shadowkv,
# sweep, 1m, trace, ttft, ttft_disk, shared, shared_trace, tier0, dp, cp, cp_kill, service, service_cp, store_node, mixed, eval. Every throughput run is beside the
# full-attention peer (bench/peer/full_attention_peer.py, which pack.sh
# copies into .device/) in the same call, the peer first and last. Every JSON
# line is tagged by bench/record.py (suite, command, commit, date, device,
# bench, units: the schema of bench/results) and appended to $OUT/bench.jsonl;
# stderr goes to $OUT/bench.err, every other log and output into
# $OUT/logs.tgz; a summary table is printed last. The commit is
# $PENUMBRA_COMMIT, else the one pack.sh wrote to .device/COMMIT, else git's
# HEAD. Results go into bench/results (see docs/benchmarks.md, generated from
# them by bench/gen_benchmarks_md.py).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}  # libcupti for --kernel-trace
R="bash .device/run"
J="$OUT/bench.jsonl"
PEER="python3 .device/full_attention_peer.py"
export PENUMBRA_COMMIT=${PENUMBRA_COMMIT:-$(cat .device/COMMIT 2>/dev/null)}
# tag SUITE COMMAND: the JSON lines on stdin as rows of the record (bench/record.py).
tag() { python3 bench/record.py tag --suite "$1" --command "$2"; }
SKV="penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --lanes 2"
STORIES=tests/data/models/stories260K
SUITE=""

usage() {
  cat <<'EOF'
usage: bash ops/device/bench.sh SUITE [SUITE...]
  parity    every *_gpu_test in the bundle; stories260K greedy on CUDA (bf16, f32, --linear auto|skinny|cublas) against its golden
  check     the independent ShadowKV reference check (ops/device/shadowkv_check.sh, PyTorch)
  full      full-attention decode at 61440 and 124928 and prefill at 124928, beside the peer (--graph decode, prefill)
  shadowkv  ShadowKV decode at 124928 x 14, two lanes, 100 steps, forced 60% and natural, the peer (--graph) first and last
  variants  ShadowKV decode at 124928 x 14 (natural, forced 60%) for each flag set of VARIANTS ('|'-separated;
            default: --landmarks-per-chunk 1|2|4), VARIANT_ROUNDS rounds (2) in turn, the peer first and last;
            the lines, with their "variant", also in $OUT/variants.jsonl
  spindlekv SpindleKV decode at 124928 tokens at the largest batch that fits, for each flag set of
            SPINDLE_VARIANTS ('|'-separated; default: reserve ratio 0.1, 0.3, and 0.1 with the paper's
            whole-codebook merge search, --spindlekv-merge-window 0), 50 steps, the peer (--graph) first and last
  specontext
            SpeContext decode at 124928 tokens (a random head) at the largest batch that fits, natural and
            forced 85% (the overlap its evaluation model's head gives at the paper's budget), for each flag set
            of SPECONTEXT_VARIANTS ('|'-separated; default: the memory model's layer placement, every layer's
            keys and values in host memory), 50 steps, the peer (--graph) first and last
  specontext_long
            long generation: SpeContext and ShadowKV from a 32768-token prompt for SPECONTEXT_LONG_STEPS (4096)
            steps at batch SPECONTEXT_LONG_BATCH (8), the peer at 32768 first
  sweep     ShadowKV context/batch sweep: 61440, 124928, 249856 with --batch-sweep and --hit-rates natural,0.6
  1m        ShadowKV at 1048576 tokens, batch 1, natural and forced 60%
  trace     a 30-step --kernel-trace of ShadowKV decode at 124928 x 14 and its summary (ops/trace_summary.py --chain);
            TRACE_ARGS replaces its '--hit-rates 0.6' (e.g. '--hit-rates natural --value-format fp8 --batch 16')
  ttft      time to first token of a 64-token question about a 124928-token document, cold and cached in memory,
            full and shadowkv (shadowkv cached: the default continuation, then the dense one), after
            prefix_reuse_gpu_test
  ttft_disk the same cached only on disk (read back after the memory cache is cleared; shadowkv cold, then
            with sparse and dense continuations: values read lazily), beside the disk's raw direct-I/O
            bandwidth (dd); TTFT_DISK_FULL=0 skips the full policy
  shared_trace
            shadowkv's shared decode (the shared suite's shape) beside the peer, then a 20-step --kernel-trace
            of it and the summary of its compute stream ($OUT/shared_trace.txt)
  shared    64 questions over one shared 124928-token document decoded as one batch (full: cascade over one
            copy of its exact KV; shadowkv), beside the peer's --shared-prefix --graph mode; the prefix-attention
            kernel's bench first
  tier0     shadowkv's shared decode (64 x 124928) with the document's values copied to spare device memory
            (--tier0 on) and left in host memory (off), between two peer --shared-prefix runs; then the TTFT of
            a question about a document already in tier 0 (TIER0_TTFT=0 skips it)
  dp        data-parallel scaling on a 2-GPU machine (kind nvidia-h100-x2): one worker per GPU behind one
            coordinator; 16 questions about one 32K-token document (one worker), then about each of two (both):
            the speedup (penumbra-service-bench --dp-documents 2); DP_POLICY=shadowkv for ShadowKV
  cp        context parallel on a 2-GPU machine (kind nvidia-h100-x2): context_parallel_gpu_test (2 GPUs give
            the one-GPU tokens), then one ShadowKV sequence decoding across both GPUs (penumbra-bench cp-decode,
            one rank per GPU over NCCL) at 1048576 and 2097152 tokens, beside 1048576 on one GPU and the peer
            (--graph, batch 1, the longest contexts it holds); CP_CONTEXTS overrides the 2-GPU contexts,
            CP_SINGLE the one-GPU ones (empty: none), CP_TEST=0 skips the test, CP_STEPS the timed steps (50),
            CP_POLICY=full for full attention (specontext, with CP_FLAGS=--specontext-head random, for
            SpeContext's one selection per step across the ranks), CP_PEER=0 skips the peer, CP_PREFILL the prompt lengths
            prefilled (full attention) on one GPU and across the GPUs, balanced and not (default: none),
            CP_FLAGS more penumbra-bench flags (e.g. --shard-selection local), CP_GPUS the ranks (2; 4 on a
            4-GPU kind)
  service   the service on the GPU (penumbra-worker with Llama-3.1-8B-shaped random weights, shadowkv, and
            penumbra-coordinator on loopback) measured by penumbra-service-bench: put a 124864-token document,
            time to first token of a 64-token question about it, then 14 such questions decoding together
            (sequences of 124928 tokens), and (shadowkv) a second document put while they decode (the longest
            token gap they see); beside penumbra-bench shared and decode at the same shape, and the
            peer (--shared-prefix --graph) first and last; SERVICE_POLICY=full for the full policy;
            SERVICE_COMPARE=0 runs the service alone (the peer once), then prints the worker's slow steps
  service_cp  a context group inside the service on a 2-GPU machine (kind nvidia-h100-x2): penumbra-worker rank 0
            and rank 1 (--group g0, one per GPU, Llama-3.1-8B-shaped random weights) formed by penumbra-coordinator
            (--groups), penumbra-service-bench putting one document of SCP_CONTEXT - 64 tokens (default 262144)
            and decoding SCP_BATCH questions about it (default 4; row "service-cp-decode"), beside
            penumbra-bench cp-decode at the same shape (SCP_BATCH sequences of SCP_CONTEXT tokens) before and
            after, and the peer (--graph, batch 1, one GPU) first; SCP_POLICY=full for full attention, SCP_PEER=0
            skips the peer, SCP_GPUS the ranks (2; 4 on a 4-GPU kind)
  store_node  penumbra-store-bench on this host's loopback: a 2 GiB blob in 16 KiB blocks read through a
            value-store node (64 blocks per message, 32 threads; the "store-node-read" row), plaintext and with
            a cluster secret (sealed), beside the local store; the store on the working copy's disk
  cp_kill   a rank of a 2-GPU cp-decode (CPK_CONTEXT tokens, default 262144) killed with SIGKILL, then stopped
            with SIGSTOP, mid-decode: how long the other rank takes to end with an error (rows "cp-rank-lost",
            seconds; --cp-timeout-s 20), never a hang
  jobs      8 documents of 32768 tokens x 16 questions: one at a time through the generate call, then as one batch
            job (service-job: wall time and tokens/s of both, answers compared); the peer's shared-prefix decode
            at 16 x 32768 beside; JOBS_POLICY=shadowkv for ShadowKV
  openai_load  the OpenAI-compatible API beside the Thrift API on one service (ops/loadtest.py --api both:
            phases thrift, openai, thrift, openai; row "service-load-http-vs-thrift"): penumbra-worker with
            Llama-3.1-8B-shaped random weights (LOAD_POLICY, default shadowkv) and penumbra-coordinator over TLS,
            one put document of LOAD_DOC random token ids (32768), LOAD_CLIENTS clients (16) asking 64-token
            questions about it, 128 tokens each, LOAD_SECONDS a phase (45); the peer's shared-prefix decode at
            that shape first. Needs .device/gen-py and .device/pylib (ops/device/pack.sh puts them there)
  mixed     the mixed-documents workload through the service (penumbra-service-bench --mixed-hot; row
            "mixed-documents"), once per KV policy in MIXED_POLICIES (default "auto full shadowkv"), each on a
            fresh penumbra-worker (Llama-3.1-8B-shaped random weights, MIXED_CACHE_MB of device memory for the
            document cache, default 60000; auto's exact forms MIXED_EXACT_MIB, default 34000: two documents) and
            penumbra-coordinator: MIXED_HOT hot documents (4) asked MIXED_QUESTIONS times (8), MIXED_COLD asked
            once (2), all of MIXED_CONTEXT tokens (124928), one every MIXED_DOC_S seconds (5), a hot one's
            questions every MIXED_Q_S (2); the peer's shared-prefix decode at MIXED_QUESTIONS x MIXED_CONTEXT
            first
  eval      penumbra eval on tests/data/evaltasks/evalmodel_4k.jsonl under full and shadowkv (models/penumbra-eval
            must travel: see ops/device/pack.sh)
EOF
}

# run TIMEOUT CMD...: CMD's JSON lines, tagged as rows of the record, into $J.
run() {
  echo "# [$SUITE] ${*:2}" >&2
  timeout "$1" "${@:2}" 2>>"$OUT/bench.err" | tag "$SUITE" "${*:2}" | tee -a "$J"
}
peer_decode() { run 200 $PEER decode --graph --steps 20 --context "$@"; }

# gpu_test NAME [ARGS...]: one GPU test binary, its log in $OUT/NAME.log.
gpu_test() {
  local t=$1; shift
  timeout 300 $R "$t" "$@" > "$OUT/$t.log" 2>&1
  local rc=$?
  echo "$t rc=$rc $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' "$OUT/$t.log" | tr '\n' ' ')"
}

suite_parity() {
  local tests
  tests=$(tar tzf .device/bundle.tgz | sed -n 's|^bin/\(.*_gpu_test\)$|\1|p' | sort)
  [ -n "$tests" ] || echo "parity: the bundle carries no *_gpu_test (ops/device/pack.sh packs them)"
  for t in $tests; do gpu_test "$t"; done
  for v in "bf16 auto" "bf16 skinny" "bf16 cublas" "f32 auto"; do
    set -- $v
    timeout 60 $R penumbra generate --model $STORIES --prompt-ids 1 --max-new-tokens 200 --greedy --json \
      --device cuda --dtype "$1" --linear "$2" > "$OUT/stories_$1_$2.json" 2> "$OUT/stories_$1_$2.err"
    echo "stories260K $1 --linear $2 rc=$?"
  done
  python3 - "$OUT" "$STORIES" <<'PY'
import json, sys
out, stories = sys.argv[1:]
golden = json.load(open(f'{stories}/golden_greedy.json'))['greedy_ids']
ids = {}
for v in ('bf16_auto', 'bf16_skinny', 'bf16_cublas', 'f32_auto'):
    try:
        ids[v] = json.load(open(f'{out}/stories_{v}.json'))['ids']
    except Exception as e:
        print(f'stories260K {v}: error {e}'); continue
    first = next((i for i, (a, b) in enumerate(zip(ids[v], golden)) if a != b), None)
    print(f'stories260K cuda {v}: golden exact={ids[v] == golden} first_divergence={first}')
if 'bf16_auto' in ids and 'bf16_skinny' in ids:
    print('bf16 --linear auto (fused SwiGLU) == skinny (unfused):', ids['bf16_auto'] == ids['bf16_skinny'])
PY
}

suite_check() {
  OUT="$OUT/check" timeout 900 bash ops/device/shadowkv_check.sh > "$OUT/shadowkv_check.log" 2>&1
  echo "shadowkv_check rc=$?"; grep -E '^(PASS|FAIL)' "$OUT/shadowkv_check.log"
  tar -C "$OUT" -czf "$OUT/shadowkv_check.tar.gz" check && rm -rf "$OUT/check"
}

suite_full() {
  peer_decode 61440 124928
  run 200 $R penumbra-bench decode --context 61440,124928 --steps 20
  run 150 $PEER prefill --context 124928
  run 150 $R penumbra-bench prefill --context 124928
  peer_decode 61440 124928
}

suite_shadowkv() {
  peer_decode 124928
  run 300 $R $SKV --context 124928 --steps 100 --hit-rates 0.6,natural
  run 200 $R $SKV --context 124928 --steps 100 --hit-rates 0.6
  peer_decode 124928
}

# Decode throughput of option variants at 124928 x 14 (natural and forced 60%),
# in alternating rounds, the peer first and last: VARIANTS is a list of
# penumbra-bench flag sets separated by '|' (default: landmarks per chunk 1, 2
# and 4), VARIANT_ROUNDS how often the list runs (2), VARIANT_STEPS the timed
# steps (50). Each line records its flags in "variant".
suite_variants() {
  local IFS_OLD=$IFS v r
  local list=${VARIANTS:-"--landmarks-per-chunk 1|--landmarks-per-chunk 2|--landmarks-per-chunk 4"}
  peer_decode 124928
  for ((r = 0; r < ${VARIANT_ROUNDS:-2}; ++r)); do
    IFS='|'
    for v in $list; do
      IFS=$IFS_OLD
      run 300 $R $SKV --context 124928 --steps "${VARIANT_STEPS:-50}" --hit-rates natural,0.6 $v |
        VARIANT="$v" ROUND=$r python3 -c '
import json, os, sys
for line in sys.stdin:
    j = json.loads(line); j["variant"] = os.environ["VARIANT"]; j["round"] = int(os.environ["ROUND"]); print(json.dumps(j))
' >> "$OUT/variants.jsonl"
    done
    IFS=$IFS_OLD
  done
  peer_decode 124928
}

# Decode at 124928 tokens once per variant (LIST: flag sets separated by
# '|', each appended to CMD), between two runs of the peer.
decode_variants_beside_peer() {
  local list=$1 v IFS_OLD=$IFS
  shift
  peer_decode 124928
  IFS='|'
  for v in $list; do
    IFS=$IFS_OLD
    run 400 $R "$@" $v
  done
  IFS=$IFS_OLD
  peer_decode 124928
}

suite_spindlekv() {
  decode_variants_beside_peer \
    "${SPINDLE_VARIANTS:-"--spindlekv-ratio 0.1|--spindlekv-ratio 0.3|--spindlekv-ratio 0.1 --spindlekv-merge-window 0"}" \
    penumbra-bench decode --kv-policy spindlekv --context 124928 --steps 50
}

suite_specontext() {
  decode_variants_beside_peer "${SPECONTEXT_VARIANTS:-"--specontext-device-layers -1|--specontext-device-layers 0"}" \
    penumbra-bench decode --kv-policy specontext --specontext-head random --context 124928 --steps 50 \
    --hit-rates natural,0.85
}

suite_specontext_long() {
  local steps=${SPECONTEXT_LONG_STEPS:-4096} batch=${SPECONTEXT_LONG_BATCH:-8}
  peer_decode 32768 --batch "$batch"
  run 590 $R penumbra-bench decode --kv-policy specontext --specontext-head random --context 32768 --batch "$batch" \
    --steps "$steps"
  run 590 $R $SKV --context 32768 --batch "$batch" --steps "$steps"
}

suite_sweep() {
  local S="$SKV --steps 100 --hit-rates natural,0.6"
  peer_decode 124928 61440
  run 300 $R $S --context 124928 --batch-sweep 2,4,8,14
  run 300 $R $S --context 61440 --batch-sweep 2,4,8,16,28
  peer_decode 249856
  run 300 $R $S --context 249856 --batch-sweep 2,4,7
  peer_decode 124928 61440
}

suite_1m() {
  run 400 $R penumbra-bench decode --kv-policy shadowkv --prefill-chunk 1024 --steps 100 --hit-rates natural,0.6 \
    --context 1048576 --batch 1
}

# The shared suite's ShadowKV decode (64 questions over one 124928-token
# document, values in tier 0) beside the peer's cascade, then 20 traced steps
# and their summary (where a shared step goes: docs/architecture.md).
suite_shared_trace() {
  local sh="penumbra-bench shared --kv-policy shadowkv --prefill-chunk 1024 --context 124928 --batch 64 --question 64"
  run 300 $PEER decode --shared-prefix --graph --batch 64 --context 124928 --steps 20
  run 400 $R $sh --steps 20
  # The traced run's own line is not a row of the record (tracing slows it).
  timeout 400 $R $sh --steps 20 --kernel-trace "$OUT/shared_trace.jsonl" > /dev/null 2>>"$OUT/bench.err"
  python3 ops/trace_summary.py "$OUT/shared_trace.jsonl" --steps 20 > "$OUT/shared_trace.txt" 2>&1
  sed -n '/stream .*(compute)/,/^stream .*(fetch)/p' "$OUT/shared_trace.txt"
  gzip -f "$OUT/shared_trace.jsonl"
  run 300 $PEER decode --shared-prefix --graph --batch 64 --context 124928 --steps 20
}

suite_trace() {
  run 300 $R $SKV --context 124928 --steps 30 ${TRACE_ARGS:---hit-rates 0.6} --kernel-trace "$OUT/trace.jsonl"
  python3 ops/trace_summary.py "$OUT/trace.jsonl" --steps 30 --chain > "$OUT/trace.txt" 2>&1
  grep -E 'fetch_to_next|link_busy|window' "$OUT/trace.txt"
  gzip -f "$OUT/trace.jsonl"
}

# disk_raw DIR: the raw direct-I/O bandwidth of DIR's disk (a 4 GiB file,
# dd oflag/iflag=direct), one JSON line.
disk_raw() {
  local f=$1/dd.bin
  mkdir -p "$1"
  df -h "$1" >&2
  dd if=/dev/zero of="$f" bs=64M count=64 oflag=direct 2> "$OUT/dd_write.txt"
  sync
  dd if="$f" of=/dev/null bs=64M iflag=direct 2> "$OUT/dd_read.txt"
  rm -f "$f"
  SUITE=$SUITE python3 - "$OUT" "$1" <<'PY' | tag "$SUITE" "dd bs=64M oflag/iflag=direct, a 4 GiB file in $1" | tee -a "$J"
import json, os, re, sys
out, path = sys.argv[1:]
j = {"mode": "disk_raw", "path": path, "suite": os.environ["SUITE"]}
for kind in ("write", "read"):
    text = open(f"{out}/dd_{kind}.txt").read()
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", text)
    if m:
        j[f"{kind}_bytes"] = int(m.group(1))
        j[f"{kind}_gb_per_s"] = int(m.group(1)) / float(m.group(2)) / 1e9
    else:
        j[f"{kind}_error"] = text.strip()[-200:]
print(json.dumps(j), flush=True)
PY
}

suite_ttft() {
  gpu_test prefix_reuse_gpu_test
  run 200 $PEER prefill --context 124928
  for p in shadowkv full; do
    run 240 $R penumbra-bench ttft --kv-policy $p --context 124928 --question 64 --cache off
    run 240 $R penumbra-bench ttft --kv-policy $p --context 124928 --question 64 --cache hbm
  done
  # The question's continuation under the default (auto: sparse for a question) beside the dense one.
  run 240 $R penumbra-bench ttft --kv-policy shadowkv --continuation dense --context 124928 --question 64 --cache hbm
}

# 64 questions over one shared 124928-token document, decoded as one batch,
# beside the peer's cascade attention over one copy of the document's KV:
# full (cascade over the document's exact KV, held once) and shadowkv; the
# prefix-attention kernel's own timing first (attention_gpu_test's bench).
suite_shared() {
  PENUMBRA_KERNEL_BENCH=1 timeout 300 $R attention_gpu_test --gtest_filter=AttentionGpuTest.Bench \
    > "$OUT/attention_bench.log" 2>&1
  grep -E '^(device|prefix|decode batch)' "$OUT/attention_bench.log"
  run 300 $PEER decode --shared-prefix --graph --batch 64 --context 124928 --steps 20
  for p in full shadowkv; do
    run 400 $R penumbra-bench shared --kv-policy $p --prefill-chunk 1024 --context 124928 --batch 64 \
      --question 64 --steps 20
  done
  run 300 $PEER decode --shared-prefix --graph --batch 64 --context 124928 --steps 20
}

# Tier 0 (issue 17): 64 questions over one shared 124928-token document with
# shadowkv, the document's values copied to spare device memory (--tier0 on)
# and left in pinned host memory (off), between two peer runs of the same
# shape; then the TTFT of a question about a document already in tier 0.
suite_tier0() {
  gpu_test prefix_reuse_gpu_test
  run 300 $PEER decode --shared-prefix --graph --batch 64 --context 124928 --steps 20
  for t in on off; do
    run 400 $R penumbra-bench shared --kv-policy shadowkv --prefill-chunk 1024 --context 124928 --batch 64 \
      --question 64 --steps 20 --tier0 $t
  done
  [ "${TIER0_TTFT:-1}" = 1 ] && run 240 $R penumbra-bench ttft --kv-policy shadowkv --context 124928 --question 64 --cache hbm
  run 300 $PEER decode --shared-prefix --graph --batch 64 --context 124928 --steps 20
}

# Data-parallel scaling (issue 21) on a 2-GPU machine (kind nvidia-h100-x2):
# one worker per GPU (Llama-3.1-8B-shaped random weights), one coordinator;
# penumbra-service-bench --dp-documents 2 puts two 32K-token documents (one
# per worker), times 16 questions about the first alone (one worker), then
# 16 about each at once (both): {"bench": "dp-scaling", "speedup": ...}.
# The peer's shared-prefix decode at 16 x 32768 on GPU 0 first, for scale
# (DP_PEER=0 skips it). DP_POLICY=shadowkv for ShadowKV.
suite_dp() {
  local P=${DP_POLICY:-full} M=configs/bench/llama-3.1-8b D="$OUT/dp"
  mkdir -p "$D"
  [ "${DP_PEER:-1}" = 1 ] &&
    CUDA_VISIBLE_DEVICES=0 run 300 $PEER decode --shared-prefix --graph --batch 16 --context 32768 --steps 20
  $R penumbra-worker --help > /dev/null 2>&1 || true  # unpacks the bundle once (two at once would race)
  local pids=() list=""
  for g in 0 1; do
    CUDA_VISIBLE_DEVICES=$g $R penumbra-worker --model $M --random-weights 1 --device cuda --kv-policy $P \
      --prefill-chunk 4096 --max-batch 64 --prefix-cache-mb 30000 --name w$g --port-file "$D/w$g.json" \
      > "$D/w$g.log" 2>&1 &
    pids+=($!)
  done
  for g in 0 1; do
    for _ in $(seq 1 600); do [ -f "$D/w$g.json" ] && break; sleep 0.5; done
    list="$list${list:+,}w$g=127.0.0.1:$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["port"])' "$D/w$g.json")"
  done
  $R penumbra-coordinator --model $M --workers "$list" --port-file "$D/coordinator.json" > "$D/coordinator.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 100); do [ -f "$D/coordinator.json" ] && break; sleep 0.2; done
  local cport; cport=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["port"])' "$D/coordinator.json")
  run 900 $R penumbra-service-bench --address 127.0.0.1:$cport --dp-documents 2 --context 32768 --question 64 \
    --batch 16 --max-new-tokens 4096 --window-s 20 --vocab 128256
  kill -TERM "${pids[@]}"; wait "${pids[@]}"
}

# Context parallel (issue 21) on a 2-GPU machine: one sequence, its shards
# on both GPUs (one penumbra-bench process per GPU, rank 0 on GPU 0 listening
# on a port the OS picks), every decode step's attention merged over NCCL:
# {"bench": "cp-decode", "gpus": 2, "context": N, "tokens_per_s": ...}.
# Beside it: the same code on one GPU (gpus 1, 1048576) and the peer at the
# longest contexts its full KV cache fits (batch 1, --graph).
suite_cp() {
  local D="$OUT/cp" CP="penumbra-bench cp-decode --kv-policy ${CP_POLICY:-shadowkv} --prefill-chunk 1024 --steps ${CP_STEPS:-50} ${CP_FLAGS:-}"
  mkdir -p "$D"
  [ "${CP_TEST:-1}" = 1 ] && gpu_test context_parallel_gpu_test
  [ "${CP_PEER:-1}" = 1 ] &&
    CUDA_VISIBLE_DEVICES=0 run 300 $PEER decode --graph --steps 20 --batch 1 --context 124928 262144
  $R penumbra-bench --help > /dev/null 2>&1 || true  # unpacks the bundle once (two at once would race)
  for S in ${CP_SINGLE-1048576}; do run 600 $R $CP --context "$S"; done
  for S in ${CP_CONTEXTS-1048576 2097152}; do cp_group "${CP_GPUS:-2}" "$S" $CP --context "$S"; done
  # CP_PREFILL: prompts prefilled on one GPU and across both (full
  # attention), balanced (the default) and not (--cp-prefill-balance off).
  local PF="penumbra-bench prefill --kv-policy full --prefill-chunk 4096"
  for S in ${CP_PREFILL-}; do
    run 600 $R $PF --context "$S"
    cp_group "${CP_GPUS:-2}" "prefill-$S" $PF --context "$S"
    cp_group "${CP_GPUS:-2}" "prefill-$S-unbalanced" $PF --context "$S" --cp-prefill-balance off
  done
  free -g | tee "$D/free.txt"
}

# cp_group N TAG CMD...: CMD as rank r of N on GPU r, rank 0's JSON lines
# through run (the others' logs in $D/rankR-TAG.log), rank 0 listening on a
# port the OS picks. cp_pair TAG CMD...: the same with N = 2.
cp_group() {
  local world=$1 tag=$2; shift 2
  rm -f "$D/port.json"
  run 600 $R "$@" --cuda-device 0 --cp-world "$world" --cp-rank 0 --cp-rendezvous 127.0.0.1:0 \
    --cp-port-file "$D/port.json" --cp-timeout-s 300 &
  local p0=$!
  for _ in $(seq 1 600); do [ -f "$D/port.json" ] && break; sleep 0.2; done
  local port; port=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["port"])' "$D/port.json")
  local pids=() r
  for r in $(seq 1 $((world - 1))); do
    timeout 600 $R "$@" --cuda-device "$r" --cp-world "$world" --cp-rank "$r" --cp-rendezvous 127.0.0.1:$port \
      --cp-timeout-s 300 > "$D/rank$r-$tag.log" 2>&1 &
    pids+=($!)
  done
  for r in $(seq 1 $((world - 1))); do
    wait "${pids[$((r - 1))]}"
    echo "cp rank $r of $world ($tag): rc=$? $(tail -c 300 "$D/rank$r-$tag.log")"
  done
  wait $p0
}
cp_pair() { cp_group 2 "$@"; }

# A context group's rank lost mid-decode (issue 40): rank 1 of a cp-decode
# pair SIGKILLed (or SIGSTOPped) once both decode; the seconds until rank 0
# exits, and its exit status: {"bench": "cp-rank-lost", "signal": ..., "seconds": ...}.
suite_cp_kill() {
  local D="$OUT/cp-kill" S=${CPK_CONTEXT:-262144}
  mkdir -p "$D"
  $R penumbra-bench --help > /dev/null 2>&1 || true  # unpacks the bundle once
  local CPB="penumbra-bench cp-decode --kv-policy shadowkv --prefill-chunk 1024 --context $S --steps 100000"
  for sig in KILL STOP; do
    rm -f "$D/port.json"
    timeout 300 $R $CPB --cuda-device 0 --cp-world 2 --cp-rank 0 --cp-rendezvous 127.0.0.1:0 \
      --cp-port-file "$D/port.json" --cp-timeout-s 20 > "$D/rank0-$sig.log" 2>&1 &
    local p0=$!
    for _ in $(seq 1 600); do [ -f "$D/port.json" ] && break; sleep 0.2; done
    local port; port=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["port"])' "$D/port.json")
    timeout 300 $R $CPB --cuda-device 1 --cp-world 2 --cp-rank 1 --cp-rendezvous 127.0.0.1:$port \
      --cp-timeout-s 20 > "$D/rank1-$sig.log" 2>&1 &
    local p1=$!
    sleep "${CPK_AFTER_S:-40}"  # both set up and decoding
    kill -0 $p0 2>/dev/null || { echo "cp_kill: rank 0 ended before SIG$sig: $(tail -c 300 "$D/rank0-$sig.log")"; continue; }
    local t0; t0=$(date +%s.%N)
    pkill -"$sig" -f -- "--cp-rank 1 --cp-rendezvous 127.0.0.1:$port"
    wait $p0; local rc=$?
    local t1; t1=$(date +%s.%N)
    pkill -KILL -f -- "--cp-rank 1 --cp-rendezvous 127.0.0.1:$port"; wait $p1 2>/dev/null
    python3 -c 'import json,sys; print(json.dumps({"bench": "cp-rank-lost", "signal": sys.argv[1], "context": int(sys.argv[2]), "seconds": round(float(sys.argv[4]) - float(sys.argv[3]), 3), "rank0_exit": int(sys.argv[5]), "timeout_s": 20}))' \
      "$sig" "$S" "$t0" "$t1" "$rc" | tag "$SUITE" "cp-decode pair, rank 1 SIG$sig" | tee -a "$J"
    grep -E "watchdog|failed|Unavailable|Deadline" "$D/rank0-$sig.log" | tail -3
  done
}

# Value-store node reads (issue 40): {"bench": "store-node-read", "gb_per_s": ...}.
suite_store_node() {
  local D=$PWD/.store-bench
  rm -rf "$D"; mkdir -p "$D"
  (umask 077; python3 -c 'import secrets; print(secrets.token_hex(32))' > "$D/cluster.secret")
  run 600 $R penumbra-store-bench --mb 2048 --threads 32 --dir "$D/store"
  run 600 $R penumbra-store-bench --mb 2048 --threads 32 --dir "$D/store" --cluster-secret-file "$D/cluster.secret"
  rm -rf "$D"
}

# A context group through the service beside cp-decode at the same shape
# (issue 40): {"bench": "service-cp-decode", "gpus": 2, "context": S,
# "batch": B, "tokens_per_s": ...} between two {"bench": "cp-decode", ...}.
suite_service_cp() {
  local P=${SCP_POLICY:-shadowkv} S=${SCP_CONTEXT:-262144} B=${SCP_BATCH:-4} N=${SCP_GPUS:-2}
  local M=configs/bench/llama-3.1-8b-4m D="$OUT/service-cp" SKVO="--kv-policy $P --prefill-chunk 1024"
  mkdir -p "$D"
  $R penumbra-bench --help > /dev/null 2>&1 || true  # unpacks the bundle once
  local CPB="penumbra-bench cp-decode $SKVO --context $S --batch $B --steps 50"
  # The peer on one GPU at the longest batch of these sequences its full KV fits.
  [ "${SCP_PEER:-1}" = 1 ] && CUDA_VISIBLE_DEVICES=0 run 300 $PEER decode --graph --steps 20 --batch 1 --context $S
  cp_group "$N" "before-$S" $CPB
  local pids=() members="" r
  for r in $(seq 0 $((N - 1))); do
    rm -f "$D/rank$r.json"
    $R penumbra-worker --model $M --random-weights 1 --device cuda --cuda-device $r $SKVO --max-batch 16 \
      --prefix-cache-mb 60000 --group g0 --group-rank $r --group-world $N --group-timeout-s 300 \
      --port-file "$D/rank$r.json" > "$D/rank$r.log" 2>&1 &
    pids+=($!)
  done
  for r in $(seq 0 $((N - 1))); do
    for _ in $(seq 1 600); do [ -f "$D/rank$r.json" ] && break; sleep 0.5; done
    members="$members${members:+,}127.0.0.1:$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["port"])' "$D/rank$r.json")"
  done
  $R penumbra-coordinator --model $M --workers "" --groups "g0=$members" \
    --group-min-tokens 1 --port-file "$D/coordinator.json" > "$D/coordinator.log" 2>&1 &
  local cpid=$!
  for _ in $(seq 1 100); do [ -f "$D/coordinator.json" ] && break; sleep 0.2; done
  local cport; cport=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["port"])' "$D/coordinator.json")
  for _ in $(seq 1 300); do grep -q "group g0 formed" "$D/coordinator.log" && break; sleep 0.2; done
  run 900 $R penumbra-service-bench --address 127.0.0.1:$cport --context $S --question 64 --batch $B \
    --max-new-tokens 4096 --window-s 20 --vocab 128256
  # The coordinator first (it cancels its generations), then rank 0 (it
  # stops the group), then the others.
  kill -TERM $cpid; wait $cpid
  for pid in "${pids[@]}"; do kill -TERM "$pid"; wait "$pid"; done
  cp_group "$N" "after-$S" $CPB
  grep -E 'formed|broken|captured|prefill piece' "$D"/rank*.log "$D/coordinator.log" | tail -20
}

# service_up DIR MODEL WORKER_FLAGS...: one penumbra-worker (random weights,
# CUDA) and a penumbra-coordinator over it on loopback, their logs in DIR;
# sets SVC_WPID, SVC_CPID and SVC_CPORT (the public API's port).
# service_down stops both (the coordinator cancels its generations first).
service_up() {
  local dir=$1 model=$2; shift 2
  $R penumbra-worker --model "$model" --random-weights 1 --device cuda "$@" --port-file "$dir/worker.json" \
    > "$dir/worker.log" 2>&1 &
  SVC_WPID=$!
  for _ in $(seq 1 600); do [ -f "$dir/worker.json" ] && break; sleep 0.5; done
  local wport; wport=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["port"])' "$dir/worker.json")
  $R penumbra-coordinator --model "$model" --workers 127.0.0.1:$wport --port-file "$dir/coordinator.json" \
    > "$dir/coordinator.log" 2>&1 &
  SVC_CPID=$!
  for _ in $(seq 1 100); do [ -f "$dir/coordinator.json" ] && break; sleep 0.2; done
  SVC_CPORT=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["port"])' "$dir/coordinator.json")
}
service_down() { kill -TERM "$SVC_CPID" "$SVC_WPID"; wait "$SVC_CPID" "$SVC_WPID"; }

# The service through its public API beside the engine alone at the same
# shape (issue 18): penumbra-bench shared (the same 14 questions over one
# document, in-process) and decode (14 independent sequences), one lane each.
# SERVICE_POLICY=full: the full policy instead (cascade over the document's
# exact KV; no independent-sequence decode line: 14 x 124928 full KV does not fit).
suite_service() {
  local P=${SERVICE_POLICY:-shadowkv}
  local M=configs/bench/llama-3.1-8b D="$OUT/service-$P" SKVO="--kv-policy $P --prefill-chunk 1024"
  mkdir -p "$D"
  run 300 $PEER decode --shared-prefix --graph --batch 14 --context 124928 --steps 20
  if [ "${SERVICE_COMPARE:-1}" = 1 ]; then
    run 400 $R penumbra-bench shared $SKVO --context 124864 --question 64 --batch 14 --steps 100
    [ "$P" = shadowkv ] &&
      run 400 $R penumbra-bench decode $SKVO --context 124928 --batch 14 --lanes 1 --steps 100 --hit-rates natural
  fi
  service_up "$D" $M $SKVO --max-batch 16 --prefix-cache-mb 60000
  run 600 $R penumbra-service-bench --address 127.0.0.1:$SVC_CPORT --context 124928 --question 64 --batch 14 \
    --max-new-tokens 2048 --window-s 20 --vocab 128256 $([ "$P" = shadowkv ] && echo --put-during-decode)
  service_down
  [ "${SERVICE_COMPARE:-1}" = 1 ] && run 300 $PEER decode --shared-prefix --graph --batch 14 --context 124928 --steps 20
  grep -E 'admitting|captured|prefill piece' "$D/worker.log" | tail -40
}

# The mixed-documents workload (issue 41: a policy per document) under each
# policy on a fresh service: {"bench": "mixed-documents", "policy": ...}.
suite_mixed() {
  local M=configs/bench/llama-3.1-8b S=${MIXED_CONTEXT:-124928} P D
  run 300 $PEER decode --shared-prefix --graph --batch "${MIXED_QUESTIONS:-8}" --context "$S" --steps 20
  for P in ${MIXED_POLICIES:-auto full shadowkv}; do
    D="$OUT/mixed-$P"
    mkdir -p "$D"
    service_up "$D" $M --kv-policy "$P" --prefill-chunk 1024 --max-batch 64 \
      --prefix-cache-mb "${MIXED_CACHE_MB:-60000}" --auto-exact-mib "${MIXED_EXACT_MIB:-34000}"
    run "${MIXED_TIMEOUT_S:-560}" $R penumbra-service-bench --address 127.0.0.1:$SVC_CPORT --context "$S" --question 64 \
      --vocab 128256 --mixed-hot "${MIXED_HOT:-4}" --mixed-questions "${MIXED_QUESTIONS:-8}" \
      --mixed-cold "${MIXED_COLD:-2}" --mixed-doc-interval-s "${MIXED_DOC_S:-5}" \
      --mixed-question-interval-s "${MIXED_Q_S:-2}" --max-new-tokens "${MIXED_NEW:-128}"
    service_down
    grep -E 'moved|captured|evict' "$D/worker.log" | tail -20
  done
}

# Batch jobs through the service (issue 19): 8 documents of 32K tokens x 16
# questions each, one at a time through the blocking generate call, then as
# one job (the coordinator with --data-dir, 16 items at once); beside the
# peer's shared-prefix decode at 16 x 32768. JOBS_POLICY=shadowkv for ShadowKV.
suite_jobs() {
  local P=${JOBS_POLICY:-full}
  local M=configs/bench/llama-3.1-8b D="$OUT/jobs-$P"
  mkdir -p "$D"
  run 300 $PEER decode --shared-prefix --graph --batch 16 --context 32768 --steps 20
  $R penumbra-worker --model $M --random-weights 1 --device cuda --kv-policy $P --prefill-chunk 1024 --max-batch 32 \
    --prefix-cache-mb 50000 --port-file "$D/worker.json" > "$D/worker.log" 2>&1 &
  local wpid=$!
  for _ in $(seq 1 600); do [ -f "$D/worker.json" ] && break; sleep 0.5; done
  local wport; wport=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["port"])' "$D/worker.json")
  $R penumbra-coordinator --model $M --workers 127.0.0.1:$wport --data-dir "$D/data" --job-concurrency 16 \
    --port-file "$D/coordinator.json" > "$D/coordinator.log" 2>&1 &
  local cpid=$!
  for _ in $(seq 1 100); do [ -f "$D/coordinator.json" ] && break; sleep 0.2; done
  local cport; cport=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["port"])' "$D/coordinator.json")
  run 600 $R penumbra-service-bench --address 127.0.0.1:$cport --context 32768 --question 64 --max-new-tokens 64 \
    --vocab 128256 --job-documents 8 --job-questions 16
  kill -TERM $cpid $wpid; wait $cpid $wpid
}

# The OpenAI-compatible API beside the Thrift API (issue 43): ops/loadtest.py
# starts the worker and the coordinator itself (penumbra_local.py), from a
# build folder of wrappers around the bundle's binaries; its Python client
# needs the generated Thrift code and the thrift package, carried in .device.
suite_openai_load() {
  local P=${LOAD_POLICY:-shadowkv} C=${LOAD_CLIENTS:-16} N=${LOAD_DOC:-32768} D="$OUT/openai-load"
  mkdir -p "$D/build/bin" "$D/build/transport"
  [ -d .device/gen-py ] && [ -d .device/pylib ] || { echo "openai_load: .device/gen-py or .device/pylib missing"; return; }
  local b
  for b in penumbra penumbra-worker penumbra-coordinator; do
    printf '#!/usr/bin/env bash\nexec bash %s/.device/run %s "$@"\n' "$PWD" "$b" > "$D/build/bin/$b"
    chmod +x "$D/build/bin/$b"
  done
  ln -sfn "$PWD/.device/gen-py" "$D/build/transport/gen-py"
  $R penumbra --help > /dev/null 2>&1 || true  # unpacks the bundle once
  run 300 $PEER decode --shared-prefix --graph --batch $C --context $((N + 64)) --steps 20
  PYTHONPATH="$PWD/.device/pylib" PENUMBRA_GEN_PY="$PWD/.device/gen-py" \
    run 900 python3 ops/loadtest.py --start configs/bench/llama-3.1-8b --build "$D/build" --device cuda --tls \
    --api both --clients $C --seconds "${LOAD_SECONDS:-45}" --max-new-tokens 128 --ignore-eos --token-ids 128256 \
    --document-tokens $N --question-tokens 64 --start-timeout 300 --grace-seconds 30 --timeout 120 \
    --worker-arg=--random-weights --worker-arg=1 --worker-arg=--kv-policy --worker-arg=$P \
    --worker-arg=--prefill-chunk --worker-arg=1024 --worker-arg=--max-batch --worker-arg=32
}

# The store lives on the disk of the working copy (not /tmp, which may be
# memory), beside the raw bandwidth of that disk.
suite_ttft_disk() {
  local store=$PWD/.ttft-store
  disk_raw "$store"
  # shadowkv: cold beside the stored document read back lazily, the question
  # continuing it sparse (reads only the values it selects before the first
  # token) and dense (waits for every value); TTFT_DISK_FULL=0 skips full.
  run 400 $R penumbra-bench ttft --kv-policy shadowkv --context 124928 --question 64 --cache off
  for c in ${TTFT_DISK_CONTINUATIONS:-sparse dense}; do
    run 400 $R penumbra-bench ttft --kv-policy shadowkv --continuation $c --context 124928 --question 64 \
      --cache disk --store-dir "$store" ${TTFT_DISK_ARGS:-}
  done
  if [ "${TTFT_DISK_FULL:-1}" = 1 ]; then
    run 400 $R penumbra-bench ttft --kv-policy full --context 124928 --question 64 --cache disk --store-dir "$store"
  fi
  rm -rf "$store"
}

suite_eval() {
  [ -f models/penumbra-eval/config.json ] || { echo "eval: models/penumbra-eval is not here (moved aside for the upload?)"; return; }
  for p in full shadowkv; do
    timeout 600 $R penumbra eval --model models/penumbra-eval --tasks tests/data/evaltasks/evalmodel_4k.jsonl \
      --kv-policy "$p" --min-prompt 1024 --json --predictions "$OUT/eval_$p.jsonl" > "$OUT/eval_$p.log" 2>>"$OUT/bench.err"
    echo "eval $p rc=$?"; tail -1 "$OUT/eval_$p.log" | tag eval "penumbra eval --model models/penumbra-eval \
--tasks tests/data/evaltasks/evalmodel_4k.jsonl --kv-policy $p --min-prompt 1024 --json" | tee -a "$J"
  done
}

summary() {
  [ -s "$J" ] || return 0
  echo "== summary ($J)"
  python3 - "$J" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    who = j.get('peer') and 'peer ' + j['peer'] or 'penumbra ' + j.get('kv_policy', '')
    what = j.get('mode', '?')
    shape = f"ctx {j.get('context', '-')} x {j.get('batch', '-')}"
    if 'tokens_per_s' in j:
        val = f"{j['tokens_per_s']:.1f} tok/s"
    elif 'ttft_client_s' in j:
        val = f"ttft {j['ttft_client_s'] * 1e3:.1f} ms (client; worker {j['ttft_worker_s'] * 1e3:.1f} ms), put {j['document_put_s']:.1f} s"
    elif 'ttft_ms' in j:
        val = f"ttft {j['ttft_ms']:.1f} ms (cache {j.get('cache')})"
    elif 'read_gb_per_s' in j:
        val = f"disk direct I/O read {j['read_gb_per_s']:.2f} GB/s, write {j.get('write_gb_per_s', 0):.2f} GB/s"
    elif 'job_tokens_per_s' in j:
        val = (f"job {j['job_tokens_per_s']:.1f} tok/s in {j['job_wall_s']:.1f} s; one at a time "
               f"{j['one_at_a_time_tokens_per_s']:.1f} tok/s in {j['one_at_a_time_wall_s']:.1f} s; "
               f"{j['answers_equal']}/{j['items']} answers equal")
    elif 'seconds' in j:
        val = f"{j['seconds']:.2f} s"
    elif 'accuracy' in j:
        val = f"accuracy {j['accuracy']}"
    else:
        val = j.get('error', '')
    extra = f"hit {j['force_hit_rate']}" if j.get('force_hit_rate', -1) >= 0 else ''
    print(f"{j.get('suite', ''):9} {who:22} {what:8} {shape:22} {val} {extra}")
PY
}

[ $# -gt 0 ] || { usage; exit 0; }
for s in "$@"; do
  case "$s" in
    help|-h|--help) usage; exit 0 ;;
    parity|check|full|shadowkv|variants|spindlekv|specontext|specontext_long|sweep|1m|trace|ttft|ttft_disk|shared|shared_trace|tier0|dp|cp|cp_kill|service|service_cp|store_node|jobs|openai_load|mixed|eval) ;;
    *) echo "unknown suite '$s'" >&2; usage >&2; exit 2 ;;
  esac
done
[ -f .device/run ] || { echo "no bundle in .device (make it with ops/device/pack.sh and carry it)" >&2; exit 2; }
nvidia-smi -L | tee "$OUT/gpu.txt"
for s in "$@"; do
  SUITE=$s
  echo "== suite $s"
  "suite_$s"
done
summary
# A call returns at most 8 files: the per-test logs and stories outputs travel
# as one archive beside bench.jsonl and bench.err.
# A second run in the same call (same $OUT) keeps the first's archive: logs-2.tgz, ...
logs=logs.tgz; n=2
while [ -e "$OUT/$logs" ]; do logs=logs-$n.tgz; n=$((n + 1)); done
(cd "$OUT" && ls | grep -vE '^(bench\.jsonl|variants\.jsonl|bench\.err|gpu\.txt|console\.log|.*\.tar\.gz|.*\.gz|logs(-[0-9]+)?\.tgz)$' > .logs) &&
  [ -s "$OUT/.logs" ] && tar -C "$OUT" -czf "$OUT/$logs" -T "$OUT/.logs" && (cd "$OUT" && xargs rm -rf < .logs)
rm -f "$OUT/.logs"
