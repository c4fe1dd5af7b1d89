# Sourced by the ops/device/bench*.sh scripts (run from the repository root
# on the GPU machine): $OUT, the bundle runner $R, and run TIMEOUT CMD...,
# which keeps the JSON lines CMD prints (in $OUT/bench.jsonl) and its stderr
# (in $OUT/bench.err).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
R="bash .device/run"
J="$OUT/bench.jsonl"
run() { echo "# $*" >&2; timeout "$1" "${@:2}" 2>>"$OUT/bench.err" | grep '^{' | tee -a "$J"; }
