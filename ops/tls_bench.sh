#!/usr/bin/env bash
# What TLS costs the service: decode tokens/s and time to first token through
# the public API with TLS off and on, on the CPU (issue 37: within 2%).
#
#   bash ops/tls_bench.sh [--pairs 3] [--max-pairs 3*PAIRS] [--context 4096] [--batch 8] [--window-s 20]
#                         [--max-others 0.05] [--out FILE]
#   (from the repository root, after: bash ops/build.sh penumbra penumbra-service-bench)
#
# Each run starts `penumbra serve` afresh (a coordinator and one CPU worker on
# $MODEL, default models/penumbra-eval, ports the OS picks, a tenant whose
# random key was made for this bench: `penumbra tenant new-key`, the key in a
# file of mode 600 that the bench reads through PENUMBRA_API_KEY_FILE) and
# measures it with penumbra-service-bench: one document of CONTEXT - 64 token
# ids put once, one 64-token question's time to first token, then BATCH
# questions about it decoding together, each followed by its own
# long-polling client on its own connection (every token crosses the public
# API and the coordinator's control-API connection to the worker), and the
# tokens all of them make in WINDOW seconds. TLS on: the topology's
# `security: {certs: DIR}` (certificates from `penumbra cert init`: mutual
# TLS between coordinator and worker, the bench checking the coordinator's
# certificate against the CA); TLS off: the same topology without it
# (plaintext on loopback).
#
# The runs come in pairs, off then on, so that drift in the machine's speed
# falls on both alike. On a small shared machine the decode rate follows
# whatever else runs (the CPU backend's BLAS threads yield to any other
# process), so each run also measures the CPU time the rest of the machine
# used meanwhile (/proc/stat's busy time less this run's processes'), and
# waits before it starts until that is under --max-others cores (up to
# --max-wait-s; 0.05: this script's own probes and the kernel's threads use
# about 0.02). A pair is quiet when both of its runs stayed under it; pairs
# are run until PAIRS quiet ones are in (at most --max-pairs). One JSON row per
# run (tokens/s, TTFT, the CPU seconds of the coordinator, the worker and the
# bench, the others' cores, the load average) and a summary row (the quiet
# pairs' mean tokens/s off and on and their ratio, each pair's ratio, what the
# coordinator and the bench spent in CPU per run) are appended to FILE
# (default bench/results/2026-11-27-cpu-tls-overhead-pairs.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS=3 MAX_PAIRS= CONTEXT=4096 BATCH=8 WINDOW=20 QUESTION=64 MAX_OTHERS=0.05 MAX_WAIT_S=600
OUT=bench/results/2026-11-27-cpu-tls-overhead-pairs.jsonl
COMMAND="bash ops/tls_bench.sh $*"
usage() {
  echo "usage: bash ops/tls_bench.sh [--pairs N] [--max-pairs M] [--context S] [--batch B] [--window-s W]" \
       "[--max-others CORES] [--max-wait-s S] [--out FILE]" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || usage
  case "$1" in
    --pairs) PAIRS=$2 ;;
    --max-pairs) MAX_PAIRS=$2 ;;
    --context) CONTEXT=$2 ;;
    --batch) BATCH=$2 ;;
    --window-s) WINDOW=$2 ;;
    --max-others) MAX_OTHERS=$2 ;;
    --max-wait-s) MAX_WAIT_S=$2 ;;
    --out) OUT=$2 ;;
    *) usage ;;
  esac
  shift 2
done
MAX_PAIRS=${MAX_PAIRS:-$((3 * PAIRS))}
BIN=build/bin
export MODEL=${MODEL:-models/penumbra-eval}
VOCAB=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$MODEL/config.json")
for b in penumbra penumbra-worker penumbra-coordinator penumbra-service-bench; do
  [ -x "$BIN/$b" ] || { echo "tls_bench: $BIN/$b is missing: bash ops/build.sh penumbra penumbra-service-bench" >&2; exit 1; }
done
HZ=$(getconf CLK_TCK)

RUN=$PWD/build/run/tls-bench
rm -rf "$RUN"
mkdir -p "$RUN"
chmod 700 "$RUN"
# A tenant for the bench: a random key (mode 600, read by the bench from its
# file) and its hash in a tenants file (admin: the bench reads the worker's
# backend and KV policy from Stats).
{ read -r KEY; read -r HASH; } < <("$BIN/penumbra" tenant new-key 2>/dev/null)
(umask 077; printf '%s\n' "$KEY" > "$RUN/api.key")
unset KEY
printf 'tenants:\n  - name: bench\n    api_keys:\n      - %s\n    admin: true\n' "$HASH" > "$RUN/tenants.yaml"
topology() {  # topology FILE [CERTS]
  cat > "$1" <<EOF
model: $MODEL
tenants: $RUN/tenants.yaml
data_dir: ""
coordinator:
  port: 0
  metrics_port: -1
  args: ["--drain-seconds", "1"]
workers:
  - name: w0
    metrics_port: -1
    args: ["--device", "cpu", "--drain-seconds", "1"]
EOF
  if [ -n "${2:-}" ]; then printf 'security:\n  certs: %s\n' "$2" >> "$1"; fi
}
topology "$RUN/plain.yaml"
topology "$RUN/tls.yaml" "$RUN/certs"
"$BIN/penumbra" cert init "$RUN/certs" --topology "$RUN/tls.yaml" > "$RUN/cert-init.log"

COMMIT=$(git rev-parse --short=12 HEAD)
git diff --quiet HEAD -- . ':!bench/results' 2>/dev/null || COMMIT="$COMMIT+dirty"
DEVICE="cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores"

# The machine's busy CPU time so far, in clock ticks (all CPUs).
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9; exit}' /proc/stat; }
# A process's CPU time so far (all its threads), in clock ticks.
cpu_of() { awk '{print $14+$15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
now() { date +%s.%N; }

# Waits until the rest of the machine uses less than MAX_OTHERS cores (3 s
# probes; nothing of ours runs meanwhile), at most MAX_WAIT_S.
wait_quiet() {
  local start=$SECONDS b0 b1 cores said=
  while :; do
    b0=$(busy); sleep 3; b1=$(busy)
    cores=$(python3 -c 'import sys; print("%.2f" % ((int(sys.argv[2]) - int(sys.argv[1])) / float(sys.argv[3]) / 3))' \
      "$b0" "$b1" "$HZ")
    python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) < float(sys.argv[2]) else 1)' "$cores" "$MAX_OTHERS" && return 0
    if [ $((SECONDS - start)) -ge "$MAX_WAIT_S" ]; then
      echo "  (the machine stayed busy: $cores cores used by others after ${MAX_WAIT_S} s; running anyway)"
      return 0
    fi
    [ -z "$said" ] && { echo "  waiting for a quiet machine (others use $cores cores) ..."; said=1; }
  done
}

SERVE=
stop_serve() {
  [ -n "$SERVE" ] || return 0
  kill -TERM "$SERVE" 2>/dev/null || true
  for _ in $(seq 1 300); do kill -0 "$SERVE" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$SERVE" 2>/dev/null || true
  wait "$SERVE" 2>/dev/null || true
  SERVE=
}
trap stop_serve EXIT

run_one() {  # run_one off|on PAIR
  local mode=$1 pair=$2 dir=$RUN/$1-$2 config
  config=$RUN/plain.yaml; [ "$mode" = on ] && config=$RUN/tls.yaml
  mkdir -p "$dir"
  local b0 t0 load0
  b0=$(busy); t0=$(now); load0=$(cut -d' ' -f1 /proc/loadavg)
  "$BIN/penumbra" serve --config "$config" --run-dir "$dir" --port-file "$dir/serve.json" \
    --start-timeout-s 120 > "$dir/serve.log" 2>&1 &
  SERVE=$!
  for _ in $(seq 1 1200); do
    [ -f "$dir/serve.json" ] && break
    kill -0 "$SERVE" 2>/dev/null || { echo "serve exited:"; cat "$dir/serve.log"; exit 1; }
    sleep 0.1
  done
  [ -f "$dir/serve.json" ] || { echo "serve not up after 120 s"; cat "$dir/serve.log"; exit 1; }
  local port coord worker
  port=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["port"])' "$dir/serve.json")
  coord=$(pgrep -P "$SERVE" -f penumbra-coordinator)
  worker=$(pgrep -P "$SERVE" -f penumbra-worker)
  local tls=()
  [ "$mode" = on ] && tls=(--tls-ca "$RUN/certs/ca.pem")
  local TIMEFORMAT='%U %S'
  { time PENUMBRA_API_KEY_FILE=$RUN/api.key "$BIN/penumbra-service-bench" --address "127.0.0.1:$port" "${tls[@]}" \
      --context "$CONTEXT" --question "$QUESTION" --batch "$BATCH" --max-new-tokens 8192 --settle-s 2 \
      --window-s "$WINDOW" --vocab "$VOCAB" > "$dir/bench.jsonl" 2> "$dir/bench.err"; } 2> "$dir/bench.time" ||
    { echo "penumbra-service-bench failed:"; cat "$dir/bench.err" "$dir"/*.log; exit 1; }
  local c_cpu w_cpu s_cpu b1 t1
  c_cpu=$(cpu_of "$coord"); w_cpu=$(cpu_of "$worker"); s_cpu=$(cpu_of "$SERVE")
  b1=$(busy); t1=$(now)
  stop_serve
  python3 - "$dir/bench.jsonl" "$OUT" "$mode" "$pair" "$load0" "$(cut -d' ' -f1 /proc/loadavg)" "$COMMIT" \
    "$DEVICE" "$COMMAND" "$HZ" "$b0" "$b1" "$t0" "$t1" "$c_cpu" "$w_cpu" "$s_cpu" "$dir/bench.time" "$MAX_OTHERS" <<'PY'
import collections, datetime, json, os, sys
(path, out, mode, pair, load0, load1, commit, device, command, hz, b0, b1, t0, t1, c_cpu, w_cpu, s_cpu, time_file,
 max_others) = sys.argv[1:]
hz = float(hz)
rows = {r["bench"]: r for r in map(json.loads, open(path))}
t, d = rows["service-ttft"], rows["service-decode"]
assert t["tls"] == (mode == "on") and d["tls"] == (mode == "on"), (mode, t, d)
run_s = float(t1) - float(t0)
coordinator_s, worker_s, serve_s = int(c_cpu) / hz, int(w_cpu) / hz, int(s_cpu) / hz
bench_s = sum(map(float, open(time_file).read().split()))
others_cores = max(0.0, ((int(b1) - int(b0)) / hz - coordinator_s - worker_s - serve_s - bench_s) / run_s)
r = collections.OrderedDict()
r["bench"] = "service-tls-overhead"
r["tls"] = mode == "on"
r["pair"] = int(pair)
r["tokens_per_s"] = round(d["tokens_per_s"], 3)
r["window_tokens"] = d["window_tokens"]
r["window_s"] = d["window_s"]
r["ttft_client_s"] = round(t["ttft_client_s"], 5)
r["ttft_worker_s"] = round(t["ttft_worker_s"], 5)
r["cached_prompt_tokens"] = t["cached_prompt_tokens"]
r["document_put_s"] = round(t["document_put_s"], 3)
r["context"] = d["context"]
r["question"] = d["question"]
r["batch"] = d["batch"]
r["kv_policy"] = d["kv_policy"]
r["backend"] = d["backend"]
r["model"] = os.environ["MODEL"]
r["run_s"] = round(run_s, 2)
r["coordinator_cpu_s"] = round(coordinator_s, 2)
r["worker_cpu_s"] = round(worker_s, 2)
r["bench_cpu_s"] = round(bench_s, 2)
r["others_cores"] = round(others_cores, 3)
r["quiet"] = others_cores < float(max_others)
r["load_avg_1m_before"] = float(load0)
r["load_avg_1m_after"] = float(load1)
r["commit"] = commit
r["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
r["device"] = device
r["command"] = command
with open(out, "a") as f:
    f.write(json.dumps(r) + "\n")
print("%-3s pair %s: %8.2f tokens/s (%d tokens in %.1f s), TTFT %.4f s client / %.4f s worker; CPU s: coordinator "
      "%.2f, bench %.2f, worker %.1f; others %.2f cores%s" % (
          mode, pair, d["tokens_per_s"], d["window_tokens"], d["window_s"], t["ttft_client_s"], t["ttft_worker_s"],
          coordinator_s, bench_s, worker_s, others_cores, "" if r["quiet"] else " (not quiet)"))
PY
}

mkdir -p "$(dirname "$OUT")"
touch "$OUT"
START_LINE=$(wc -l < "$OUT")
echo "tls_bench: $PAIRS quiet pairs (off, on; at most $MAX_PAIRS), context $CONTEXT, batch $BATCH, window $WINDOW s;" \
     "rows to $OUT"
quiet_pairs() {
  python3 - "$OUT" "$START_LINE" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]).read().splitlines()[int(sys.argv[2]):]]
rows = [r for r in rows if r["bench"] == "service-tls-overhead"]
pairs = {}
for r in rows:
    pairs.setdefault(r["pair"], []).append(r["quiet"])
print(sum(1 for q in pairs.values() if len(q) == 2 and all(q)))
PY
}
pair=0
while [ "$(quiet_pairs)" -lt "$PAIRS" ] && [ "$pair" -lt "$MAX_PAIRS" ]; do
  pair=$((pair + 1))
  wait_quiet
  run_one off "$pair"
  wait_quiet
  run_one on "$pair"
done
python3 - "$OUT" "$START_LINE" "$COMMIT" "$DEVICE" "$COMMAND" "$MAX_OTHERS" <<'PY'
import collections, datetime, json, sys
out, start, commit, device, command, max_others = sys.argv[1:]
rows = [json.loads(l) for l in open(out).read().splitlines()[int(start):]]
rows = [r for r in rows if r["bench"] == "service-tls-overhead"]
by_pair = {}
for r in rows:
    by_pair.setdefault(r["pair"], {})["on" if r["tls"] else "off"] = r
complete = {p: v for p, v in by_pair.items() if len(v) == 2}
quiet = {p: v for p, v in complete.items() if v["off"]["quiet"] and v["on"]["quiet"]}
mean = lambda v: sum(v) / len(v) if v else None
use = quiet or complete
off_tps = mean([v["off"]["tokens_per_s"] for v in use.values()])
on_tps = mean([v["on"]["tokens_per_s"] for v in use.values()])
ratio = lambda v: round(v["on"]["tokens_per_s"] / v["off"]["tokens_per_s"], 4)
s = collections.OrderedDict()
s["bench"] = "service-tls-overhead-summary"
s["pairs"] = len(complete)
s["quiet_pairs"] = len(quiet)
s["summary_of"] = "quiet pairs" if quiet else "all pairs (none was quiet: the numbers are noise)"
s["off_tokens_per_s"] = round(off_tps, 3)
s["on_tokens_per_s"] = round(on_tps, 3)
s["on_off_ratio"] = round(on_tps / off_tps, 4)
s["pair_ratios"] = [ratio(use[p]) for p in sorted(use)]
s["all_pair_ratios"] = [ratio(complete[p]) for p in sorted(complete)]
s["off_ttft_client_s"] = round(mean([v["off"]["ttft_client_s"] for v in use.values()]), 5)
s["on_ttft_client_s"] = round(mean([v["on"]["ttft_client_s"] for v in use.values()]), 5)
# What TLS costs in CPU where it runs besides the worker: the coordinator
# (both ends of its TLS: the public API and its connections to the worker)
# and the bench's clients, per run.
s["off_coordinator_bench_cpu_s"] = round(mean([v["off"]["coordinator_cpu_s"] + v["off"]["bench_cpu_s"]
                                               for v in use.values()]), 3)
s["on_coordinator_bench_cpu_s"] = round(mean([v["on"]["coordinator_cpu_s"] + v["on"]["bench_cpu_s"]
                                              for v in use.values()]), 3)
s["within_2_percent"] = abs(on_tps / off_tps - 1) <= 0.02
s["max_others_cores"] = float(max_others)
s["context"], s["batch"], s["window_s"] = rows[0]["context"], rows[0]["batch"], rows[0]["window_s"]
s["commit"] = commit
s["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
s["device"] = device
s["command"] = command
with open(out, "a") as f:
    f.write(json.dumps(s) + "\n")
print("TLS on/off decode tokens/s (%s, %d of %d pairs): %.2f / %.2f = %.4f (pairs: %s; all pairs: %s); "
      "TTFT %.4f s on, %.4f s off; coordinator+bench CPU per run %.2f s on, %.2f s off" % (
          s["summary_of"], len(use), len(complete), on_tps, off_tps, s["on_off_ratio"],
          ", ".join("%.4f" % x for x in s["pair_ratios"]), ", ".join("%.4f" % x for x in s["all_pair_ratios"]),
          s["on_ttft_client_s"], s["off_ttft_client_s"], s["on_coordinator_bench_cpu_s"],
          s["off_coordinator_bench_cpu_s"]))
PY
