#!/usr/bin/env bash
# What TLS costs the service: the same decode workload through the public API
# with every plane in plaintext and with every plane over TLS (certificates
# from `penumbra cert init`), alternated ROUNDS times, on the CPU. Each run is
# `penumbra serve` (a coordinator and a CPU worker) measured by
# penumbra-service-bench: a document put once, then BATCH questions about it
# decoding together for WINDOW_S seconds (each followed by its own
# long-polling client, so every token crosses the public API and the control
# API). One JSON line per run is appended to OUT with the commit, date,
# machine and command, and a summary line gives TLS on / off.
#   bash ops/tls_bench.sh [OUT]    (from the repository root, after ops/build.sh)
# Env: MODEL (default models/penumbra-eval), CONTEXT (2048), QUESTION (32),
#      BATCH (8), WINDOW_S (20), ROUNDS (2), BIN (build/bin).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/$(date -u +%F)-cpu-tls-overhead.jsonl}
MODEL=${MODEL:-models/penumbra-eval}
CONTEXT=${CONTEXT:-2048}
QUESTION=${QUESTION:-32}
BATCH=${BATCH:-8}
WINDOW_S=${WINDOW_S:-20}
ROUNDS=${ROUNDS:-2}
BIN=${BIN:-build/bin}
VOCAB=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$MODEL/config.json")
RUN=$(mktemp -d /tmp/penumbra-tls-bench-XXXXXX)
SERVE=
cleanup() {
  [ -n "$SERVE" ] && { kill -TERM "$SERVE" 2>/dev/null; wait "$SERVE" 2>/dev/null || true; }
  rm -rf "$RUN"
}
trap cleanup EXIT

cat > "$RUN/plain.yaml" <<EOF
model: $MODEL
coordinator: {host: 127.0.0.1, port: 0, metrics_port: -1}
workers:
  - {name: w0, host: 127.0.0.1, port: 0, metrics_port: -1, args: ["--device", "cpu"]}
EOF
{ cat "$RUN/plain.yaml"; echo "security: {certs: $RUN/certs}"; } > "$RUN/tls.yaml"
"$BIN/penumbra" cert init "$RUN/certs" --topology "$RUN/tls.yaml" > /dev/null

COMMIT=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!bench/results' || echo "+uncommitted")
CPU=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
run() {  # run plain|tls ROUND
  local mode=$1 dir="$RUN/$1-$2"
  mkdir -p "$dir"
  "$BIN/penumbra" serve --config "$RUN/$mode.yaml" --data-dir "" --run-dir "$dir" --port-file "$dir/serve.json" \
    > "$dir/serve.log" 2>&1 &
  SERVE=$!
  for _ in $(seq 1 600); do
    [ -f "$dir/serve.json" ] && break
    kill -0 "$SERVE" 2>/dev/null || { echo "serve exited:"; cat "$dir"/*.log; exit 1; }
    sleep 0.1
  done
  local port
  port=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["port"])' "$dir/serve.json")
  local tls=()
  [ "$mode" = tls ] && tls=(--tls-ca "$RUN/certs/ca.pem")
  local cmd=("$BIN/penumbra-service-bench" --address "127.0.0.1:$port" --context "$CONTEXT" --question "$QUESTION"
             --batch "$BATCH" --max-new-tokens 16384 --window-s "$WINDOW_S" --settle-s 2 --vocab "$VOCAB" "${tls[@]}")
  "${cmd[@]}" > "$dir/bench.jsonl"
  kill -TERM "$SERVE"; wait "$SERVE" || true; SERVE=
  python3 - "$dir/bench.jsonl" "$OUT" "$mode" "$COMMIT" "$CPU" "$MODEL" "$2" "${cmd[*]}" "$port" "$RUN" <<'PY'
import datetime, json, sys
src, out, mode, commit, cpu, model, rnd, cmd, port, run = sys.argv[1:]
env = " ".join("%s=%s" % kv for kv in [("MODEL", model)])
with open(out, "a") as f:
    for line in open(src):
        row = json.loads(line)
        row.update({"suite": "tls-overhead", "tls_mode": mode, "round": int(rnd), "commit": commit,
                    "date": datetime.date.today().isoformat(), "device": "cpu: " + cpu, "model": model,
                    "command": "bash ops/tls_bench.sh",
                    "bench_command": cmd.replace("127.0.0.1:" + port, "127.0.0.1:PORT").replace(run, "$RUN")})
        f.write(json.dumps(row) + "\n")
        if row["bench"] == "service-decode":
            print("%-5s round %s: %.1f tokens/s" % (mode, rnd, row["tokens_per_s"]), file=sys.stderr)
PY
}
mkdir -p "$(dirname "$OUT")"
for r in $(seq 1 "$ROUNDS"); do
  run plain "$r"
  run tls "$r"
done
python3 - "$OUT" "$COMMIT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rows = [r for r in rows if r.get("suite") == "tls-overhead" and r["commit"] == sys.argv[2] and r["bench"] == "service-decode"]
mean = lambda m: sum(r["tokens_per_s"] for r in rows if r["tls_mode"] == m) / max(1, sum(r["tls_mode"] == m for r in rows))
plain, tls = mean("plain"), mean("tls")
print(json.dumps({"suite": "tls-overhead", "plain_tokens_per_s": round(plain, 2), "tls_tokens_per_s": round(tls, 2),
                  "tls_over_plain": round(tls / plain, 4) if plain else None, "runs": len(rows)}))
PY
