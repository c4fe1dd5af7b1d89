#!/usr/bin/env bash
# The sanitizer jobs (CI runs both after the main tests; CMakePresets.json
# names their builds):
#   bash ops/sanitize.sh asan   build-asan/: the CPU backend under
#                               AddressSanitizer + UndefinedBehaviorSanitizer,
#                               every test but the GPU ones
#   bash ops/sanitize.sh tsan   build-tsan/: ThreadSanitizer on the threaded
#                               parts (scheduler, service, store, job and
#                               document stores, TLS servers) and their tests
# A report fails the test that made it (halt_on_error; the suppressions of
# ops/tsan.supp name the uninstrumented libraries' own races, each with why).
# Build output goes to build-<job>/logs/build.log.
set -euo pipefail
cd "$(dirname "$0")/.."
job=${1:?usage: ops/sanitize.sh asan|tsan}
source ops/quiet.sh
dir=build-$job
mkdir -p "$dir/logs"
case "$job" in
  asan)
    quiet_step "configure: $dir (ASan+UBSan, CPU backend)" "$dir/logs/configure.log" cmake --preset asan
    quiet_step "build: $dir" "$dir/logs/build.log" ninja -C "$dir" -j"$(nproc)"
    ;;
  tsan)
    quiet_step "configure: $dir (TSan, CPU backend)" "$dir/logs/configure.log" cmake --preset tsan
    # The processes the service tests start, and the tests of the threaded parts.
    targets=(penumbra-worker penumbra-coordinator penumbra-store penumbra
             scheduler_test scheduler_store_io_test service_test store_node_integration_test
             segment_store_test job_store_test job_store_integration_test document_registry_test
             document_registry_integration_test request_journal_test tombstones_test tls_planes_test)
    quiet_step "build: $dir (${#targets[@]} targets)" "$dir/logs/build.log" ninja -C "$dir" -j"$(nproc)" "${targets[@]}"
    ;;
  *) echo "ops/sanitize.sh: unknown job $job (asan|tsan)" >&2; exit 2 ;;
esac
if [ "$job" = tsan ]; then
  # Only the tests whose programs this build made (the preset's name filter
  # would also match tests of targets left out above).
  pick=$(python3 -c 'import json; print(next(t for t in json.load(open("CMakePresets.json"))["testPresets"] if t["name"] == "tsan")["filter"]["include"]["name"])')
  names=$(cd "$dir" && ctest --show-only=json-v1 | python3 -c '
import json, os, re, sys
pick = re.compile(sys.argv[1])
for t in json.load(sys.stdin)["tests"]:
    cmd = t.get("command") or []
    if pick.search(t["name"]) and cmd and os.path.exists(cmd[0]) and cmd[0].startswith(os.getcwd()):
        print("^" + re.escape(t["name"]) + "$")
' "$pick" | paste -sd'|')
  [ -n "$names" ] || { echo "ops/sanitize.sh: no TSan test was built" >&2; exit 1; }
  ctest --preset tsan -j"$(nproc)" --timeout 1800 -R "$names"
else
  ctest --preset "$job" -j"$(nproc)" --timeout 1800
fi
