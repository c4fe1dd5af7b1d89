#!/usr/bin/env bash
# A context group started by `penumbra serve` (labels service and
# distributed): a topology with one group of two CPU ranks and no single
# worker, certificates from `penumbra cert init` (the ranks' group is mutual
# TLS, its formation's secret handed over the coordinator's mutual-TLS
# control plane), an admin tenant. The coordinator forms the group by itself
# (`penumbra stats` shows both ranks formed); a document put with `penumbra
# doc put` and asked about twice with `penumbra ask` is attached on every
# rank (cached tokens = its tokens) and answered the same both times; a
# question without the document is answered too. SIGTERM stops everything.
#   tests/service/serve_group_test.sh BIN_DIR   (from the repository root)
set -u
BIN=${1:?usage: serve_group_test.sh BIN_DIR}
MODEL=models/penumbra-eval
[ -f "$MODEL/tokenizer.json" ] || { echo "model missing: $MODEL"; exit 1; }
RUN=$(mktemp -d /tmp/penumbra-serve-group-test-XXXXXX)
source "$(dirname "$0")/serve_lib.sh"

unset PENUMBRA_API_KEY PENUMBRA_TLS_CERT PENUMBRA_TLS_KEY
serve_tenant ops admin
cat > "$RUN/service.yaml" <<YAML
model: $MODEL
tenants: $RUN/tenants.yaml
security:
  certs: $RUN/certs
coordinator:
  port: 0
  metrics_port: -1
  args: ["--drain-seconds", "2", "--group-min-tokens", "64"]
groups:
  - name: g0
    args: ["--device", "cpu", "--drain-seconds", "2", "--group-timeout-s", "20"]
    ranks:
      - {name: g0r0}
      - {name: g0r1}
YAML
"$BIN/penumbra" cert init "$RUN/certs" --topology "$RUN/service.yaml" > "$RUN/cert-init.log" ||
  fail "penumbra cert init: $(cat "$RUN/cert-init.log")"
[ -f "$RUN/certs/g0r1.pem" ] || fail "cert init made no certificate for the group's rank 1"
export PENUMBRA_TLS_CA=$RUN/certs/ca.pem PENUMBRA_API_KEY_FILE=$RUN/api.key

start_serve

formed=0
for _ in $(seq 1 300); do
  if pen stats --json && python3 - "$RUN/out" <<'PY'
import json, sys
w = json.load(open(sys.argv[1])).get("workers", [])
ranks = [x for x in w if x.get("group") == "g0"]
sys.exit(0 if len(ranks) == 2 and all(x.get("group_state") == "formed" for x in ranks) else 1)
PY
  then formed=1; break; fi
  sleep 0.2
done
[ "$formed" = 1 ] || fail "the group never formed: $(cat "$RUN/out" "$RUN/err")"
grep -q "formed (formation [0-9]*, mutual TLS" "$RUN"/run/g0r1.log || fail "rank 1 did not join over mutual TLS"

head -c 6000 tests/data/evaltasks/haystack_kjv.txt > "$RUN/doc.txt"
pen doc put "$RUN/doc.txt" --name kjv --json || fail "doc put: $(cat "$RUN/err")"
DOC=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["id"])' "$RUN/out")
TOKENS=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["tokens"])' "$RUN/out")
[ "$TOKENS" -gt 64 ] || fail "the document has only $TOKENS tokens"
ask() {
  pen ask --docs "$DOC" --question "Who is named in the first verse?" --max-new-tokens 12 --ignore-eos --json ||
    fail "ask: $(cat "$RUN/err")"
  python3 - "$RUN/out" "$TOKENS" <<'PY' || fail "ask: $(cat "$RUN/out")"
import json, sys
r = json.load(open(sys.argv[1]))
u = r["usage"]
assert r["finish_reason"] == "length", r
assert u["generated_tokens"] == 12, u
assert u["cached_prompt_tokens"] == int(sys.argv[2]), u
print(json.dumps(r["text"]))
PY
}
A1=$(ask) || exit 1
A2=$(ask) || exit 1
[ "$A1" = "$A2" ] || fail "two greedy answers differ: $A1 vs $A2"
pen ask --question "Once upon a time" --max-new-tokens 8 --ignore-eos --json || fail "ask without a document: $(cat "$RUN/err")"
grep -q '"finish_reason":"length"' "$RUN/out" || fail "ask without a document: $(cat "$RUN/out")"
stop_serve
echo "PASS"
