#!/usr/bin/env bash
# `penumbra job` against real processes: `penumbra serve` with a topology
# whose data_dir turns batch jobs on (a coordinator and a CPU worker on
# models/penumbra-eval, ports the OS picks; TLS on every plane with
# certificates from `penumbra cert init`, one tenant whose key was made for
# the test: the CLI reads the CA and the key file from PENUMBRA_TLS_CA and
# PENUMBRA_API_KEY_FILE, and is refused without either), a document put with
# `penumbra doc put`, then: bad job files refused naming the line and key (nothing
# submitted); a 6-item job (4 single items and a 2-question line) submitted
# and waited for, its results (6 lines, distinct custom ids, all ok) on stdout
# and in a file; status, ls; a detached job followed to its end; the finished
# jobs still listed after serve restarts on the same data_dir (the worker's
# documents kept on a value-store node serve starts); rm, and
# NOT_FOUND for a removed or unknown id.
#   tests/service/job_cli_test.sh BIN_DIR   (from the repository root)
set -u
BIN=${1:?usage: job_cli_test.sh BIN_DIR}
MODEL=models/penumbra-eval
[ -f "$MODEL/tokenizer.json" ] || { echo "model missing: $MODEL"; exit 1; }
RUN=$(mktemp -d /tmp/penumbra-job-cli-test-XXXXXX)
source "$(dirname "$0")/serve_lib.sh"

unset PENUMBRA_API_KEY PENUMBRA_TLS_CERT PENUMBRA_TLS_KEY
# A tenant: its key in a file of mode 600, only the hash in the tenants file.
serve_tenant jobs
cat > "$RUN/service.yaml" <<EOF
model: $MODEL
data_dir: $RUN/data
tenants: $RUN/tenants.yaml
security:
  certs: $RUN/certs
coordinator:
  port: 0
  metrics_port: -1
  args: ["--drain-seconds", "2"]
workers:
  - name: w0
    args: ["--device", "cpu", "--drain-seconds", "2"]
store_nodes:
  - name: s0
    path: $RUN/store
EOF

"$BIN/penumbra" cert init "$RUN/certs" --topology "$RUN/service.yaml" > "$RUN/cert-init.log" ||
  fail "penumbra cert init: $(cat "$RUN/cert-init.log")"
export PENUMBRA_TLS_CA=$RUN/certs/ca.pem PENUMBRA_API_KEY_FILE=$RUN/api.key

T0=$(date +%s)
start_serve

# Without the key, or without the CA (plaintext to the TLS port), nothing is served.
PENUMBRA_API_KEY_FILE= pen job ls && fail "job ls without a key succeeded"
grep -q "PermissionDenied" "$RUN/err" || fail "job ls without a key: $(cat "$RUN/err")"
PENUMBRA_TLS_CA= pen job ls && fail "job ls without the CA succeeded"
grep -q "Unavailable" "$RUN/err" || fail "job ls without the CA: $(cat "$RUN/err")"

# Bad files: refused before anything is sent, naming the file, line and key.
printf '%s\n' '{"custom_id": "a", "question": "Q"}' '' '{"custom_id": "b", "question": "Q", "max_new_tokens": 0}' \
  > "$RUN/bad1.jsonl"
printf '%s\n' '{"custom_id": "a", "question": "Q", "temprature": 0.5}' > "$RUN/bad2.jsonl"
printf '%s\n' '{"custom_id_prefix": "p", "questions": ["x", "y"]}' '{"custom_id": "p-1", "question": "Q"}' \
  > "$RUN/bad3.jsonl"
printf '%s\n' '{"custom_id": "a", "question": "Q"' > "$RUN/bad4.jsonl"
printf '%s\n' '{"custom_id": "a", "question": "Q", "kv_policy": "fast"}' > "$RUN/bad5.jsonl"
printf '%s\n' '{"custom_id": "a", "questions": ["Q"]}' > "$RUN/bad6.jsonl"
printf '%s\n' '{"custom_id": "a", "question": "Q", "stop": "\n"}' > "$RUN/bad7.jsonl"
expect_refused() {  # FILE TEXT
  pen job submit "$RUN/$1" && fail "$1 was accepted"
  [ $? -eq 2 ] || fail "$1: exit status not 2"
  grep -qF -- "$2" "$RUN/err" || fail "$1: expected '$2' in: $(cat "$RUN/err")"
}
expect_refused bad1.jsonl "bad1.jsonl:3: \"max_new_tokens\" must be an integer in [1, 1048576], got 0"
expect_refused bad2.jsonl "bad2.jsonl:1: unknown key \"temprature\""
expect_refused bad3.jsonl "bad3.jsonl:2: custom_id \"p-1\" is already used on line 1"
expect_refused bad4.jsonl "bad4.jsonl:1: not JSON"
expect_refused bad5.jsonl "bad5.jsonl:1: \"kv_policy\" must be \"full\", \"shadowkv\", \"spindlekv\" or \"specontext\", got \"fast\""
expect_refused bad6.jsonl "bad6.jsonl:1: \"custom_id\" goes with \"question\"; use \"custom_id_prefix\""
expect_refused bad7.jsonl "bad7.jsonl:1: \"stop\" must be a list of at most 16 strings"
pen job ls || fail "job ls: $(cat "$RUN/err")"
[ ! -s "$RUN/out" ] || fail "a refused file made a job: $(cat "$RUN/out")"

# A document.
cat > "$RUN/story.txt" <<'EOF'
Once upon a time, there was a little girl named Lily. She lived in a small house near the park with her mom and her
dog, Max. Every morning Lily and Max went to the park to play with a red ball. One day Max found a shiny key under a
big tree. Lily took the key home and showed it to her mom. Her mom smiled and said it was the key to the old garden
gate. They opened the gate together and found a garden full of flowers.
EOF
pen doc put "$RUN/story.txt" --json || fail "doc put: $(cat "$RUN/err")"
DOC=$(python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); assert d["state"] == "ready", d; print(d["id"])' \
  "$RUN/out") || fail "doc put: $(cat "$RUN/out")"

# Six items: four lines of one item, one line of two questions.
{
  for i in 0 1 2 3; do
    echo "{\"custom_id\": \"q$i\", \"documents\": [\"$DOC\"], \"question\": \"\\n\\nQuestion $i: What did Max find?\\nAnswer:\", \"max_new_tokens\": 8, \"stop\": [\"\\n\"]}"
  done
  echo "{\"custom_id_prefix\": \"fan\", \"documents\": [\"$DOC\"], \"questions\": [\"\\nWho is Lily?\", \"\\nWhere is the park?\"], \"max_new_tokens\": 6, \"temperature\": 0.7, \"seed\": 3}"
} > "$RUN/jobs.jsonl"
pen job submit "$RUN/jobs.jsonl" --metadata "cli test" || fail "job submit: $(cat "$RUN/out" "$RUN/err")"
grep -qP '^job-\S+\tcompleted\t6 items: 6 completed, 0 failed, 0 cancelled\t' "$RUN/out" || fail "job submit printed: $(cat "$RUN/out")"
grep -q "6/6 done" "$RUN/err" || fail "no final progress line: $(cat "$RUN/err")"
JOB=$(cut -f1 "$RUN/out")

pen job results "$JOB" || fail "job results: $(cat "$RUN/err")"
cp "$RUN/out" "$RUN/results.stdout"
pen job results "$JOB" --out "$RUN/results.jsonl" || fail "job results --out: $(cat "$RUN/err")"
cmp -s "$RUN/results.stdout" "$RUN/results.jsonl" || fail "results on stdout and in --out differ"
python3 - "$RUN/results.jsonl" <<'PY' || fail "job results: $(cat "$RUN/results.jsonl")"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert len(rows) == 6, len(rows)
ids = sorted(r["custom_id"] for r in rows)
assert ids == ["fan-0", "fan-1", "q0", "q1", "q2", "q3"], ids
for r in rows:
    assert r["ok"] is True and r["state"] == "succeeded" and r["error"] == "", r
    assert r["finish_reason"] in ("stop", "length") and isinstance(r["text"], str), r
    assert r["usage"]["generated_tokens"] >= 1 and r["usage"]["cached_prompt_tokens"] > 0, r
PY

pen job status "$JOB" --json || fail "job status: $(cat "$RUN/err")"
python3 -c '
import json, sys
j = json.load(open(sys.argv[1]))
assert j["id"] == sys.argv[2] and j["status"] == "completed" and j["total"] == 6 and j["completed"] == 6, j
assert j["metadata"] == "cli test" and j["finished_unix_s"] >= j["created_unix_s"] > 0, j' "$RUN/out" "$JOB" ||
  fail "job status: $(cat "$RUN/out")"

# Detached: the id at once, then followed with status.
echo "{\"custom_id\": \"one\", \"documents\": [\"$DOC\"], \"question\": \"\\nThe key\", \"max_new_tokens\": 4}" > "$RUN/one.jsonl"
pen job submit "$RUN/one.jsonl" --detach || fail "job submit --detach: $(cat "$RUN/err")"
JOB2=$(cat "$RUN/out")
[[ "$JOB2" =~ ^job-[^[:space:]]+$ ]] || fail "job submit --detach printed: $JOB2"
for _ in $(seq 1 100); do
  pen job status "$JOB2" || fail "job status: $(cat "$RUN/err")"
  grep -qP "^\Q$JOB2\E\tcompleted\t1/1 done" "$RUN/out" && break
  sleep 0.2
done
grep -qP "\tcompleted\t1/1 done \(1 completed, 0 failed, 0 cancelled\)" "$RUN/out" || fail "detached job: $(cat "$RUN/out")"

# What the data directory keeps: both jobs and their results, after a restart.
stop_serve
start_serve
# The worker keeps its documents on the value-store node serve started; the
# node, restarted on its directory, still holds them.
grep -qE "serving $RUN/store \(([1-9][0-9]*) documents\)" "$RUN/run/s0.log" ||
  fail "the store node holds no document after the restart: $(cat "$RUN/run/s0.log")"
pen job ls || fail "job ls: $(cat "$RUN/err")"
[ "$(cut -f1 "$RUN/out" | tr '\n' ' ')" = "$JOB $JOB2 " ] || fail "job ls after restart: $(cat "$RUN/out")"
pen job results "$JOB" || fail "job results after restart: $(cat "$RUN/err")"
cmp -s "$RUN/out" "$RUN/results.jsonl" || fail "results changed across the restart"

pen job rm "$JOB" || fail "job rm: $(cat "$RUN/err")"
grep -qx "deleted $JOB" "$RUN/out" || fail "job rm printed: $(cat "$RUN/out")"
pen job ls || fail "job ls: $(cat "$RUN/err")"
[ "$(cut -f1 "$RUN/out")" = "$JOB2" ] || fail "job ls after rm: $(cat "$RUN/out")"
for id in "$JOB" job-does-not-exist; do
  pen job status "$id" && fail "job status of $id succeeded"
  [ $? -eq 1 ] || fail "job status $id: exit status not 1"
  grep -q "NotFound" "$RUN/err" || fail "job status $id: $(cat "$RUN/err")"
done
stop_serve
echo "ok ($(( $(date +%s) - T0 )) s)"
