#!/usr/bin/env bash
# penumbra serve (a coordinator and a CPU worker on stories260K, ports the OS
# picks) measured by penumbra-service-bench at a small size: its JSON lines
# (service-ttft, service-decode, service-decode-during-put) come out with the document served from the
# cache, its batch-job mode (service-job) gives the one-at-a-time answers, and
# serve stops on SIGTERM with nothing left running.
#   tests/service/service_bench_test.sh BIN_DIR   (from the repository root)
set -u
BIN=${1:?usage: service_bench_test.sh BIN_DIR}
MODEL=tests/data/models/stories260K
[ -f "$MODEL/model.safetensors" ] || { echo "test data missing: $MODEL/model.safetensors"; exit 1; }
RUN=$(mktemp -d /tmp/penumbra-service-bench-test-XXXXXX)
"$BIN/penumbra" serve --model "$MODEL" --data-dir "$RUN/data" --port 0 --metrics-port 0 --run-dir "$RUN" --port-file "$RUN/serve.json" \
  --worker-args "--device cpu" > "$RUN/serve.log" 2>&1 &
SERVE=$!
cleanup() { kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null; rm -rf "$RUN"; }
trap cleanup EXIT
for _ in $(seq 1 600); do
  [ -f "$RUN/serve.json" ] && break
  kill -0 $SERVE 2>/dev/null || { echo "serve exited:"; cat "$RUN/serve.log" "$RUN"/*.log; exit 1; }
  sleep 0.1
done
[ -f "$RUN/serve.json" ] || { echo "serve not up after 60 s"; cat "$RUN/serve.log"; exit 1; }
PORT=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["port"])' "$RUN/serve.json")
"$BIN/penumbra-service-bench" --address 127.0.0.1:$PORT --context 300 --question 16 --batch 4 \
  --max-new-tokens 200 --settle-s 0 --window-s 0.05 --vocab 512 --put-during-decode > "$RUN/bench.jsonl" || {
  echo "penumbra-service-bench failed"; cat "$RUN"/*.log; exit 1; }
cat "$RUN/bench.jsonl"
python3 - "$RUN/bench.jsonl" <<'PY' || exit 1
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
t, d, p = lines
assert t["bench"] == "service-ttft" and t["cached_prompt_tokens"] == 284 and t["ttft_client_s"] > 0, t
assert d["bench"] == "service-decode" and d["batch"] == 4 and d["context"] == 300 and d["tokens_per_s"] > 0, d
assert p["bench"] == "service-decode-during-put" and p["max_token_gap_s"] > 0 and p["tokens_per_s"] > 0, p
print("ok")
PY
# The batch-job mode: 2 documents x 3 questions, one at a time and as a job.
"$BIN/penumbra-service-bench" --address 127.0.0.1:$PORT --context 200 --question 8 --max-new-tokens 5 \
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
[ $rc -eq 0 ] || { echo "serve exited $rc"; cat "$RUN/serve.log"; exit 1; }
echo "serve stopped cleanly"
