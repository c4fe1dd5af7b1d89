#!/usr/bin/env bash
# What TLS costs the service: decode tokens/s and time to first token through
# the public API with TLS off and on, on the CPU (issue 37: within 2%).
#
#   bash ops/tls_bench.sh [--pairs 3] [--context 4096] [--batch 8] [--window-s 20] [--out FILE]
#   (from the repository root, after: bash ops/build.sh penumbra penumbra-service-bench)
#
# Each run starts `penumbra serve` afresh (a coordinator and one CPU worker on
# $MODEL, default models/penumbra-eval, ports the OS picks, a tenant whose
# random key was made for this bench: `penumbra tenant new-key`, the key in a
# file of mode 600 that the bench reads through PENUMBRA_API_KEY_FILE) and
# measures it with penumbra-service-bench: one document of
# CONTEXT - 64 token ids put once, one 64-token question's time to first
# token, then BATCH questions about it decoding together, each followed by its
# own long-polling client on its own connection, and the tokens all of them
# make in WINDOW seconds. TLS on: the topology's `security: {certs: DIR}`
# (certificates from `penumbra cert init`: mutual TLS between coordinator and
# worker, the bench checking the coordinator's certificate against the CA);
# TLS off: the same topology without it (plaintext on loopback). The runs
# alternate off, on, off, on, ... (PAIRS pairs), so that drift in the
# machine's speed falls on both alike. One JSON row per run and a summary row
# (mean tokens/s of each, on/off ratio, each pair's ratio) are appended to
# FILE (default bench/results/2026-11-27-cpu-tls-overhead.jsonl); the load
# average before and after each run is in its row (other work on the machine
# makes the numbers noisy: run it when the machine is quiet).
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS=3 CONTEXT=4096 BATCH=8 WINDOW=20 QUESTION=64
OUT=bench/results/2026-11-27-cpu-tls-overhead.jsonl
COMMAND="bash ops/tls_bench.sh $*"
while [ $# -gt 0 ]; do
  case "$1" in
    --pairs) PAIRS=$2; shift 2 ;;
    --context) CONTEXT=$2; shift 2 ;;
    --batch) BATCH=$2; shift 2 ;;
    --window-s) WINDOW=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "usage: bash ops/tls_bench.sh [--pairs N] [--context S] [--batch B] [--window-s W] [--out FILE]" >&2
       exit 2 ;;
  esac
done
BIN=build/bin
export MODEL=${MODEL:-models/penumbra-eval}
VOCAB=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$MODEL/config.json")
for b in penumbra penumbra-worker penumbra-coordinator penumbra-service-bench; do
  [ -x "$BIN/$b" ] || { echo "tls_bench: $BIN/$b is missing: bash ops/build.sh penumbra penumbra-service-bench" >&2; exit 1; }
done

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
  "$BIN/penumbra" serve --config "$config" --run-dir "$dir" --port-file "$dir/serve.json" \
    --start-timeout-s 120 > "$dir/serve.log" 2>&1 &
  SERVE=$!
  for _ in $(seq 1 1200); do
    [ -f "$dir/serve.json" ] && break
    kill -0 "$SERVE" 2>/dev/null || { echo "serve exited:"; cat "$dir/serve.log"; exit 1; }
    sleep 0.1
  done
  [ -f "$dir/serve.json" ] || { echo "serve not up after 120 s"; cat "$dir/serve.log"; exit 1; }
  local port load0
  port=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["port"])' "$dir/serve.json")
  load0=$(cut -d' ' -f1 /proc/loadavg)
  local tls=()
  [ "$mode" = on ] && tls=(--tls-ca "$RUN/certs/ca.pem")
  PENUMBRA_API_KEY_FILE=$RUN/api.key "$BIN/penumbra-service-bench" --address "127.0.0.1:$port" "${tls[@]}" \
    --context "$CONTEXT" --question "$QUESTION" --batch "$BATCH" --max-new-tokens 8192 --settle-s 2 \
    --window-s "$WINDOW" --vocab "$VOCAB" > "$dir/bench.jsonl" 2> "$dir/bench.err" ||
    { echo "penumbra-service-bench failed:"; cat "$dir/bench.err" "$dir"/*.log; exit 1; }
  stop_serve
  python3 - "$dir/bench.jsonl" "$OUT" "$mode" "$pair" "$load0" "$(cut -d' ' -f1 /proc/loadavg)" "$COMMIT" \
    "$DEVICE" "$COMMAND" <<'PY'
import collections, datetime, json, os, sys
path, out, mode, pair, load0, load1, commit, device, command = sys.argv[1:]
rows = {r["bench"]: r for r in map(json.loads, open(path))}
t, d = rows["service-ttft"], rows["service-decode"]
assert t["tls"] == (mode == "on") and d["tls"] == (mode == "on"), (mode, t, d)
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
r["load_avg_1m_before"] = float(load0)
r["load_avg_1m_after"] = float(load1)
r["commit"] = commit
r["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
r["device"] = device
r["command"] = command
with open(out, "a") as f:
    f.write(json.dumps(r) + "\n")
print("%-3s pair %s: %8.2f tokens/s (%d tokens in %.1f s), TTFT %.4f s client / %.4f s worker, load %s -> %s" % (
    mode, pair, d["tokens_per_s"], d["window_tokens"], d["window_s"], t["ttft_client_s"], t["ttft_worker_s"],
    load0, load1))
PY
}

mkdir -p "$(dirname "$OUT")"
START_LINE=$( [ -f "$OUT" ] && wc -l < "$OUT" || echo 0)
echo "tls_bench: $PAIRS pairs (off, on), context $CONTEXT, batch $BATCH, window $WINDOW s; rows to $OUT"
for pair in $(seq 1 "$PAIRS"); do
  run_one off "$pair"
  run_one on "$pair"
done
python3 - "$OUT" "$START_LINE" "$COMMIT" "$DEVICE" "$COMMAND" <<'PY'
import collections, datetime, json, sys
out, start, commit, device, command = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
rows = [json.loads(l) for l in open(out).read().splitlines()[start:]]
rows = [r for r in rows if r["bench"] == "service-tls-overhead"]
off = {r["pair"]: r for r in rows if not r["tls"]}
on = {r["pair"]: r for r in rows if r["tls"]}
mean = lambda v: sum(v) / len(v)
off_tps, on_tps = mean([r["tokens_per_s"] for r in off.values()]), mean([r["tokens_per_s"] for r in on.values()])
s = collections.OrderedDict()
s["bench"] = "service-tls-overhead-summary"
s["pairs"] = len(off)
s["off_tokens_per_s"] = round(off_tps, 3)
s["on_tokens_per_s"] = round(on_tps, 3)
s["on_off_ratio"] = round(on_tps / off_tps, 4)
s["pair_ratios"] = [round(on[p]["tokens_per_s"] / off[p]["tokens_per_s"], 4) for p in sorted(off)]
s["off_ttft_client_s"] = round(mean([r["ttft_client_s"] for r in off.values()]), 5)
s["on_ttft_client_s"] = round(mean([r["ttft_client_s"] for r in on.values()]), 5)
s["within_2_percent"] = abs(on_tps / off_tps - 1) <= 0.02
s["context"], s["batch"] = rows[0]["context"], rows[0]["batch"]
s["load_avg_1m_max"] = max(max(r["load_avg_1m_before"], r["load_avg_1m_after"]) for r in rows)
s["commit"] = commit
s["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
s["device"] = device
s["command"] = command
with open(out, "a") as f:
    f.write(json.dumps(s) + "\n")
print("TLS on/off decode tokens/s: %.2f / %.2f = %.4f (pairs: %s); TTFT %.4f s on, %.4f s off" % (
    on_tps, off_tps, s["on_off_ratio"], ", ".join("%.4f" % x for x in s["pair_ratios"]), s["on_ttft_client_s"],
    s["off_ttft_client_s"]))
PY
