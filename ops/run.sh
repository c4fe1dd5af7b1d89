#!/usr/bin/env bash
# The main job on its embedded default: set up, build, start the service on
# loopback (`penumbra serve`: a coordinator and one worker serving the
# project's own long-context model, models/penumbra-eval, on the GPU when
# there is one, else on the CPU) as a deployment runs it: TLS on every plane
# with certificates made for this run (`penumbra cert init`) and one tenant
# whose API key is made for this run (`penumbra tenant new-key`: the key in a
# file of mode 600, only its hash in the tenants file); put a 4K-token document once
# (ops/examples/kv_4k.txt: 66 keys and their values), ask it two questions
# through the public API, print the answers and their usage (the document's
# tokens come from the document cache, not prefilled again), and stop the
# service. Set-up and build print one line each (their output goes to
# build/logs/, shown in full only on failure). What the run makes is in
# build/run/main (mode 700): service.yaml (configs/service.yaml with
# security.certs and tenants set), certs/, tenants.yaml, api.key and the
# logs. The client commands find the CA and the key file in PENUMBRA_TLS_CA
# and PENUMBRA_API_KEY_FILE (a key is never on a command line).
#   bash ops/run.sh [--kv-policy shadowkv ...]   extra arguments go to the worker
#   PENUMBRA_MODEL=DIR bash ops/run.sh           another model, offline, from token id 1
set -euo pipefail
cd "$(dirname "$0")/.."
source ops/quiet.sh
LOGS=build/logs
quiet_step "setup: Debian packages (log: $LOGS/setup.log)" "$LOGS/setup.log" bash ops/setup.sh
quiet_step "build: penumbra, penumbra-worker, penumbra-coordinator (log: $LOGS/build.log; the first build takes a few minutes)" \
  "$LOGS/build.log" bash ops/build.sh penumbra
if [ -n "${PENUMBRA_MODEL:-}" ]; then
  exec ./build/bin/penumbra generate --model "$PENUMBRA_MODEL" --prompt-ids 1 --max-new-tokens 200 --greedy "$@"
fi

RUN=build/run/main
rm -rf "$RUN"
mkdir -p "$RUN"
chmod 700 "$RUN"
# A tenant for this run: a fresh random key in a file only we can read, its
# hash in the tenants file. (admin: the last line reads the worker's name and
# backend from Stats, which only an admin tenant sees.)
{ read -r KEY; read -r KEY_HASH; } < <(./build/bin/penumbra tenant new-key 2>/dev/null)
(umask 077; printf '%s\n' "$KEY" > "$RUN/api.key")
unset KEY
printf '%s\n' "# Made by ops/run.sh for this run: the key is in api.key (mode 600), only its hash is here." \
  "tenants:" "  - name: main" "    api_keys:" "      - $KEY_HASH" "    admin: true" > "$RUN/tenants.yaml"
# The run's topology: configs/service.yaml with tenants and security.certs
# set; then a CA and a certificate for each of its processes.
python3 - configs/service.yaml "$RUN/service.yaml" "$PWD/$RUN/tenants.yaml" "$PWD/$RUN/certs" <<'PY'
import re, sys
src, dst, tenants, certs = sys.argv[1:]
text = open(src).read()
for key, value in (("tenants", tenants), ("  certs", certs)):
    text, n = re.subn(r'^%s: *""' % key, "%s: %s" % (key, value), text, count=1, flags=re.M)
    if n != 1:
        sys.exit("ops/run.sh: %s has no line '%s: \"\"' to set" % (src, key.strip()))
open(dst, "w").write(text)
PY
./build/bin/penumbra cert init "$RUN/certs" --topology "$RUN/service.yaml" > "$RUN/cert-init.log"
echo "security: TLS on every plane (certificates made for this run in $RUN/certs); a tenant key made for this run ($RUN/api.key)"
./build/bin/penumbra serve --config "$RUN/service.yaml" --port 0 --metrics-port 0 --run-dir "$RUN" \
  --port-file "$RUN/serve.json" --worker-args "$*" > "$RUN/serve.log" 2>&1 &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
printf 'serve: a coordinator and a worker on loopback (logs: %s) ... ' "$RUN"
t0=$SECONDS
until [ -f "$RUN/serve.json" ]; do
  if ! kill -0 $SERVE 2>/dev/null; then
    echo "failed"; cat "$RUN/serve.log"; exit 1
  fi
  sleep 0.2
done
echo "done ($((SECONDS - t0))s)"
PORT=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["port"])' "$RUN/serve.json")
export PENUMBRA_ADDRESS=127.0.0.1:$PORT PENUMBRA_TLS_CA=$RUN/certs/ca.pem PENUMBRA_API_KEY_FILE=$RUN/api.key

DOC=$(./build/bin/penumbra doc put ops/examples/kv_4k.txt --name kv_4k --json)
python3 - "$DOC" <<'PY'
import json, sys
d = json.loads(sys.argv[1])
print(f'put: ops/examples/kv_4k.txt -> {d["id"]} ({d["tokens"]} tokens, factored once in {d["factor_seconds"]:.2f} s '
      f'on worker {d["worker"]})')
PY
ID=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["id"])' "$DOC")

ask() {  # ask KEY EXPECTED
  local q="Q: What is the value of key $1?"
  echo
  echo "$q   (expected $2)"
  ./build/bin/penumbra ask --docs "$ID" --question "$q\\nA:" --max-new-tokens 40 --stop '\n' --json > "$RUN/answer.json"
  python3 - "$RUN/answer.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
u = r["usage"]
print("A:", r["text"].strip())
print(f'   ({u["prompt_tokens"]} prompt tokens, {u["cached_prompt_tokens"]} of them from the document cache; '
      f'{u["generated_tokens"]} generated; first token {u["ttft_seconds"]:.3f} s; {r["tokens_per_s"]:.1f} tokens/s)')
PY
}
ask 311e272d-9985-36ed-e20f-9904e233dbda d85b02ee-e3b0-bd45-7c00-29173587570a
ask 3cfe7289-723b-0583-912a-ba88e99d9671 f02460d8-7556-e45a-c890-89134e15e17f
echo
./build/bin/penumbra stats --json > "$RUN/stats.json"
python3 - "$RUN/stats.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
w = s["workers"][0]
print(f'stats: {s["requests"]} requests, {s["cached_prompt_tokens"]} of {s["prompt_tokens"]} prompt tokens from the '
      f'document cache; worker {w["name"]} on {w["backend"]}, KV policy {w["kv_policy"]}')
PY
