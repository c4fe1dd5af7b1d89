#!/usr/bin/env bash
# The sanitizer jobs (CI runs both after the main tests; CMakePresets.json
# names their builds and tests; tests/README.md says how to run and extend them):
#   bash ops/sanitize.sh asan   build-asan/: the CPU backend under
#                               AddressSanitizer + UndefinedBehaviorSanitizer:
#                               the in-process tests (labels unit and
#                               integration) and the multi-process ones (label
#                               service: real workers, coordinators and store
#                               nodes, all ASan-built), but those named in the
#                               preset's exclude (too long instrumented)
#   bash ops/sanitize.sh tsan   build-tsan/: ThreadSanitizer on the threaded
#                               parts in process (scheduler, segment store,
#                               journal, job and document stores) and on the
#                               service: every case of service_test (TSan-built
#                               penumbra-worker, penumbra-coordinator and
#                               penumbra-store processes) and
#                               store_node_integration_test
# A report fails the test that made it (halt_on_error). A report of a process
# a test started fails that test too (tests/service/service_cluster.h reads
# each process's log), and any report left in the tests' output fails the
# job (the check after ctest). The suppressions of ops/tsan.supp name the
# uninstrumented libraries' own races, each with why. UCX's memory hooks are
# off under TSan (the preset's UCX_MEM_* variables): with them every thread's
# exit crashes. Build output goes to build-<job>/logs/build.log.
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
    # The threaded parts in process, the store node's processes and the
    # service's (the service tests run the penumbra-* programs of this build).
    targets=(scheduler_test scheduler_store_io_test shadowkv_objects_test
             segment_store_test job_store_test job_store_integration_test document_registry_test
             document_registry_integration_test request_journal_test tombstones_test
             store_node_integration_test service_test penumbra-worker penumbra-coordinator penumbra-store)
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
# A report that failed no test (e.g. a store node's, on the stderr of a test
# that passed) still fails the job: ctest keeps every test's output.
reports='WARNING: ThreadSanitizer:|ERROR: (Thread|Address|Leak)Sanitizer:|: runtime error: '
if grep -Eq "$reports" "$dir/Testing/Temporary/LastTest.log"; then
  grep -En -B2 -A30 "$reports" "$dir/Testing/Temporary/LastTest.log" | head -400
  echo "ops/sanitize.sh: a sanitizer report in the tests' output (all of it: $dir/Testing/Temporary/LastTest.log)" >&2
  exit 1
fi
