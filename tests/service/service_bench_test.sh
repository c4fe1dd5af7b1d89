#!/usr/bin/env bash
# penumbra serve (a coordinator and a CPU worker on stories260K, ports the OS
# picks, TLS on every plane with certificates from `penumbra cert init`, one
# tenant whose key was made for the test) measured by penumbra-service-bench
# at a small size, as a deployment's operator runs it: the CA from --tls-ca
# and the key from --api-key-file (or PENUMBRA_TLS_CA and
# PENUMBRA_API_KEY_FILE). Its JSON lines (service-ttft, service-decode,
# service-decode-during-put) come out with the document served from the
# cache and "tls": true, its batch-job mode (service-job) gives the
# one-at-a-time answers; without the CA, without the key, or with the key on
# the command line it is refused (the key not repeated); serve stops on
# SIGTERM with nothing left running.
#   tests/service/service_bench_test.sh BIN_DIR   (from the repository root)
set -u
BIN=${1:?usage: service_bench_test.sh BIN_DIR}
MODEL=tests/data/models/stories260K
[ -f "$MODEL/model.safetensors" ] || { echo "test data missing: $MODEL/model.safetensors"; exit 1; }
RUN=$(mktemp -d /tmp/penumbra-service-bench-test-XXXXXX)
SERVE=
cleanup() { [ -n "$SERVE" ] && { kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null; }; rm -rf "$RUN"; }
trap cleanup EXIT
unset PENUMBRA_API_KEY PENUMBRA_API_KEY_FILE PENUMBRA_TLS_CA PENUMBRA_TLS_CERT PENUMBRA_TLS_KEY PENUMBRA_ADDRESS

# A tenant: its key in a file of mode 600, the hash in the tenants file
# (admin: the bench reads the worker's backend and KV policy from Stats).
{ read -r KEY; read -r HASH; } < <("$BIN/penumbra" tenant new-key 2>/dev/null)
(umask 077; printf '%s\n' "$KEY" > "$RUN/api.key")
printf 'tenants:\n  - name: bench\n    api_keys:\n      - %s\n    admin: true\n' "$HASH" > "$RUN/tenants.yaml"
cat > "$RUN/service.yaml" <<EOF
model: $MODEL
tenants: $RUN/tenants.yaml
data_dir: $RUN/data
security:
  certs: $RUN/certs
coordinator:
  port: 0
  metrics_port: 0
workers:
  - name: w0
    args: ["--device", "cpu"]
EOF
"$BIN/penumbra" cert init "$RUN/certs" --topology "$RUN/service.yaml" > "$RUN/cert-init.log" || {
  echo "penumbra cert init failed"; cat "$RUN/cert-init.log"; exit 1; }
"$BIN/penumbra" serve --config "$RUN/service.yaml" --run-dir "$RUN" --port-file "$RUN/serve.json" \
  > "$RUN/serve.log" 2>&1 &
SERVE=$!
for _ in $(seq 1 600); do
  [ -f "$RUN/serve.json" ] && break
  kill -0 $SERVE 2>/dev/null || { echo "serve exited:"; cat "$RUN/serve.log" "$RUN"/*.log; exit 1; }
  sleep 0.1
done
[ -f "$RUN/serve.json" ] || { echo "serve not up after 60 s"; cat "$RUN/serve.log"; exit 1; }
PORT=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["port"])' "$RUN/serve.json")
# The decode window: short enough that no answer ends inside it in an
# optimized build, long enough under a sanitizer (the presets set
# ASAN_OPTIONS or TSAN_OPTIONS) to see tokens at all.
WINDOW=0.05
[ -n "${ASAN_OPTIONS:-}${TSAN_OPTIONS:-}" ] && WINDOW=1
SMALL=(--context 300 --question 16 --batch 4 --max-new-tokens 200 --settle-s 0 --window-s $WINDOW --vocab 512)
"$BIN/penumbra-service-bench" --address 127.0.0.1:$PORT --tls-ca "$RUN/certs/ca.pem" --api-key-file "$RUN/api.key" \
  "${SMALL[@]}" --put-during-decode > "$RUN/bench.jsonl" || {
  echo "penumbra-service-bench failed"; cat "$RUN"/*.log; exit 1; }
cat "$RUN/bench.jsonl"
python3 - "$RUN/bench.jsonl" <<'PY' || exit 1
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
t, d, p = lines
assert t["bench"] == "service-ttft" and t["cached_prompt_tokens"] == 284 and t["ttft_client_s"] > 0, t
assert d["bench"] == "service-decode" and d["batch"] == 4 and d["context"] == 300 and d["tokens_per_s"] > 0, d
assert p["bench"] == "service-decode-during-put" and p["max_token_gap_s"] > 0 and p["tokens_per_s"] > 0, p
assert t["tls"] is True and d["tls"] is True, (t, d)
assert d["backend"] == "cpu" and d["kv_policy"] == "full", d
print("ok")
PY
# Refused: no CA (a plaintext client gets nothing from the TLS port), no key,
# the key on the command line (an unknown flag; the key not repeated).
refused() {  # WHAT EXPECTED_TEXT CMD...
  local what=$1 text=$2; shift 2
  if "$@" "${SMALL[@]}" > "$RUN/refused.out" 2> "$RUN/refused.err"; then echo "FAIL: $what succeeded"; exit 1; fi
  grep -q -- "$text" "$RUN/refused.err" || { echo "FAIL: $what: expected '$text' in: $(cat "$RUN/refused.err")"; exit 1; }
  if grep -qF -- "$KEY" "$RUN/refused.out" "$RUN/refused.err"; then echo "FAIL: $what printed the key"; exit 1; fi
}
refused "no CA" "Unavailable" env PENUMBRA_API_KEY_FILE="$RUN/api.key" "$BIN/penumbra-service-bench" --address 127.0.0.1:$PORT
refused "no key" "PermissionDenied" "$BIN/penumbra-service-bench" --address 127.0.0.1:$PORT --tls-ca "$RUN/certs/ca.pem"
refused "the key in argv" "unknown flag --api-key" "$BIN/penumbra-service-bench" --address 127.0.0.1:$PORT \
  --tls-ca "$RUN/certs/ca.pem" --api-key "$KEY"
echo "refused without the CA, without the key, and with the key on the command line"
# The batch-job mode: 2 documents x 3 questions, one at a time and as a job
# (the CA and the key from the environment).
PENUMBRA_TLS_CA="$RUN/certs/ca.pem" PENUMBRA_API_KEY_FILE="$RUN/api.key" "$BIN/penumbra-service-bench" \
  --address 127.0.0.1:$PORT --context 200 --question 8 --max-new-tokens 5 \
  --vocab 512 --job-documents 2 --job-questions 3 > "$RUN/job.jsonl" || {
  echo "penumbra-service-bench --job-documents failed"; cat "$RUN/job.jsonl" "$RUN"/*.log; exit 1; }
cat "$RUN/job.jsonl"
python3 - "$RUN/job.jsonl" <<'PY' || exit 1
import json, sys
j = json.loads(open(sys.argv[1]).read())
assert j["bench"] == "service-job" and j["items"] == 6 and j["failed_items"] == 0, j
assert j["answers_equal"] == 6 and j["job_tokens_per_s"] > 0 and j["one_at_a_time_tokens_per_s"] > 0, j
print("ok")
PY
kill -TERM $SERVE
for _ in $(seq 1 300); do kill -0 $SERVE 2>/dev/null || break; sleep 0.1; done
if kill -0 $SERVE 2>/dev/null; then echo "serve still running 30 s after SIGTERM"; exit 1; fi
wait $SERVE; rc=$?
SERVE=
[ $rc -eq 0 ] || { echo "serve exited $rc"; cat "$RUN/serve.log"; exit 1; }
echo "serve stopped cleanly"
