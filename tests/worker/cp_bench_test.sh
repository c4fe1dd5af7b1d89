#!/usr/bin/env bash
# penumbra-bench cp-decode (full, shadowkv, specontext) and prefill (full) on the CPU
# backend with a tiny model: two ranks (processes) over TCP on loopback, rank
# 0 on a port the OS picks; rank 0 must print a measurement with gpus 2 and
# no error, rank 1 must exit 0. Usage: cp_bench_test.sh BIN_DIR
set -u
bin=${1:?usage: cp_bench_test.sh BIN_DIR}
dir=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$dir"' EXIT
shape="--device cpu --dtype f32 --layers 2 --hidden 256 --ffn 512 --heads 4 --kv-heads 2 --head-dim 64 --vocab 1000"
for run in "cp-decode --kv-policy full" "cp-decode --kv-policy shadowkv --rank 32 --budget 256 --outliers 4" \
           "cp-decode --kv-policy specontext --specontext-head random --specontext-budget 256" \
           "prefill --kv-policy full --prefill-chunk 512"; do
  rm -f "$dir/port.json"
  "$bin/penumbra-bench" $run $shape --context 4096 --steps 4 --cp-world 2 --cp-rank 0 \
    --cp-rendezvous 127.0.0.1:0 --cp-port-file "$dir/port.json" --cp-timeout-s 60 > "$dir/rank0.out" 2>&1 &
  p0=$!
  for _ in $(seq 1 300); do [ -f "$dir/port.json" ] && break; sleep 0.1; done
  port=$(sed -n 's/.*"port": *\([0-9]*\).*/\1/p' "$dir/port.json")
  [ -n "$port" ] || { echo "rank 0 wrote no port"; cat "$dir/rank0.out"; exit 1; }
  "$bin/penumbra-bench" $run $shape --context 4096 --steps 4 --cp-world 2 --cp-rank 1 \
    --cp-rendezvous "127.0.0.1:$port" --cp-timeout-s 60 > "$dir/rank1.out" 2>&1
  rc1=$?
  wait $p0; rc0=$?
  cat "$dir/rank0.out"
  [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] || { echo "$run: rank 0 rc=$rc0, rank 1 rc=$rc1"; cat "$dir/rank1.out"; exit 1; }
  grep -q '"gpus":2' "$dir/rank0.out" && ! grep -q '"error"' "$dir/rank0.out" || { echo "$run: no measurement"; exit 1; }
done
echo OK
