# What the shell tests of `penumbra serve` share (source it after setting
# BIN, the build's bin directory, and RUN, the test's temporary folder):
#   serve_tenant NAME [admin]  a tenant with a fresh API key: the key in
#                              $RUN/api.key (mode 600), only its hash in
#                              $RUN/tenants.yaml
#   start_serve                serve --config $RUN/service.yaml (run dir
#                              $RUN/run), waits for its port file and exports
#                              PENUMBRA_ADDRESS
#   stop_serve                 SIGTERM, then SIGKILL after 20 s
#   fail TEXT...               prints TEXT and the end of every log, exits 1
#   pen ARGS...                penumbra ARGS with a bound: stdout to
#                              $RUN/out, stderr to $RUN/err
# An EXIT trap stops serve and removes $RUN.
SERVE=
stop_serve() {
  [ -n "$SERVE" ] || return 0
  kill -TERM "$SERVE" 2>/dev/null
  for _ in $(seq 1 200); do kill -0 "$SERVE" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$SERVE" 2>/dev/null
  wait "$SERVE" 2>/dev/null
  SERVE=
}
cleanup() { stop_serve; rm -rf "$RUN"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$RUN"/run/*.log "$RUN"/serve.log; do [ -f "$f" ] && { echo "== $f"; tail -30 "$f"; }; done; exit 1; }
serve_tenant() {
  local key hash admin=""
  { read -r key; read -r hash; } < <("$BIN/penumbra" tenant new-key 2>/dev/null)
  (umask 077; printf '%s\n' "$key" > "$RUN/api.key")
  [ "${2:-}" = admin ] && admin="    admin: true\n"
  printf "tenants:\n  - name: %s\n${admin}    api_keys:\n      - %s\n" "$1" "$hash" > "$RUN/tenants.yaml"
}
start_serve() {
  rm -f "$RUN/serve.json"
  "$BIN/penumbra" serve --config "$RUN/service.yaml" --run-dir "$RUN/run" --port-file "$RUN/serve.json" \
    --start-timeout-s 60 > "$RUN/serve.log" 2>&1 &
  SERVE=$!
  for _ in $(seq 1 600); do
    [ -f "$RUN/serve.json" ] && break
    kill -0 "$SERVE" 2>/dev/null || fail "serve exited"
    sleep 0.1
  done
  [ -f "$RUN/serve.json" ] || fail "serve not up after 60 s"
  PORT=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["port"])' "$RUN/serve.json")
  export PENUMBRA_ADDRESS=127.0.0.1:$PORT
}
pen() { timeout 120 "$BIN/penumbra" "$@" > "$RUN/out" 2> "$RUN/err"; }
