# Sourced by ops/run.sh and ops/test.sh: runs set-up and build steps quietly.
#   quiet_step LABEL LOG CMD...
# runs CMD with stdout and stderr appended to LOG and prints one line,
# "LABEL ... done (12s)". On a terminal the line shows the build's progress
# ([N/M] from ninja) while it runs. When CMD fails, the whole LOG is printed,
# then "LABEL failed (exit N); log: LOG", and the script exits with CMD's status.
quiet_step() {
  local label=$1 log=$2; shift 2
  mkdir -p "$(dirname "$log")"
  : > "$log"
  local t0=$SECONDS rc=0 ticker=
  if [ -t 1 ]; then
    (
      while sleep 1; do
        p=$(grep -o '^\[[0-9]*/[0-9]*\]' "$log" 2>/dev/null | tail -1)
        printf '\r%s ... %s %ds ' "$label" "$p" $((SECONDS - t0))
      done
    ) &
    ticker=$!
  else
    printf '%s ... ' "$label"
  fi
  "$@" >>"$log" 2>&1 || rc=$?
  if [ -n "$ticker" ]; then
    kill "$ticker" 2>/dev/null; wait "$ticker" 2>/dev/null
    printf '\r\033[K%s ... ' "$label"
  fi
  if [ "$rc" -ne 0 ]; then
    echo "failed"
    echo "----- $log -----"
    cat "$log"
    echo "----- end of $log -----"
    echo "$label failed (exit $rc); log: $log" >&2
    exit "$rc"
  fi
  echo "done ($((SECONDS - t0))s)"
}
