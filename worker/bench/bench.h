// penumbra-bench's modes (bench_main.cc dispatches; one file each:
// bench_decode.cc, bench_cp_decode.cc, bench_prefill.cc, bench_ttft.cc,
// bench_shared.cc) and what they share. Each mode measures one context of S
// tokens and prints its JSON line(s) on stdout; a flag error is
// InvalidArgument (the run ends with exit status 2).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "common/args.h"
#include "common/status.h"
#include "worker/bench/kernel_trace.h"
#include "worker/engine/engine.h"
#include "worker/parallel/context_group.h"

namespace penumbra::bench {

// What every JSON line starts with: its mode and the device's name.
struct Common {
  std::string gpu;
  nlohmann::json Line(const std::string& mode) const {
    nlohmann::json j;
    j["mode"] = mode;
    j["gpu"] = gpu;
    return j;
  }
};

// The KV policy's name and, under shadowkv, the options that change its
// state's shape and bytes (chunk size, landmarks and their format, the
// values' format), into j: every mode's line names what it measured.
void AddPolicy(const EngineOptions& o, nlohmann::json& j);

// --kernel-trace PATH: empty when not given; refused without a path or off
// the CUDA backend (InvalidArgument naming the flag).
Result<std::string> KernelTracePath(const Args& a, const Backend& b);

// Stops `trace` and writes its records to `path` (ops/trace_summary.py reads
// it); names the file and the record count in j (a traced run is slower than
// an untraced one).
Status FinishKernelTrace(KernelTrace& trace, const std::string& path, nlohmann::json& j);

// --profile: steps after the timed ones whose ops are timed one by one.
inline constexpr int kProfileSteps = 5;

// kProfileSteps calls of `step` with every op of rt timed (synchronized: no
// overlap), sampling included: per-op milliseconds over all of them.
Status ProfileSteps(Backend& b, Runtime& rt, const std::function<Status()>& step, std::map<std::string, double>* ms);

// Per step: where the time goes (ProfileSteps' milliseconds), into j.
void AddProfile(const std::map<std::string, double>& ms, nlohmann::json& j);

// With --lanes N the batch is split round-robin over N lanes (sequence i on
// lane i % N), each driven by its own host thread (lane 0 by this one): 2
// warm-up steps, a barrier, `steps` timed steps and a synchronize per lane.
// The step time is the wall time from the barrier's release to the last lane
// finishing, divided by `steps`. N = 1 is the single-pipeline loop.
//
// The batch is built once (the costly part: SVD, landmarks and offload of
// every sequence). --batch-sweep times the first b sequences of it for each b
// (the others wait), and --hit-rates repeats every measurement for each
// forced hit rate, each a JSON line of its own.
// `trace_pending`: --kernel-trace has not traced a measurement yet (of any context).
Status RunDecode(const Args& a, Engine& e, const Common& cm, int64_t S, double copy_gbps, bool* trace_pending);

// One sequence (or --batch of them) of S tokens decoding across the ranks of
// a context-parallel group (`group`, null: this process alone): each rank
// synthesizes its shard (random keys and values through the policy's real
// compression path) and every rank runs the same steps; the step time is
// rank 0's wall time over `steps` steps after 2 warm-up steps, all ranks
// synchronized at its start and end.
Status RunCpDecode(const Args& a, Engine& e, const Common& cm, int64_t S, Collective* group);

// With a context group (--cp-world): the prompt's shards prefilled by the
// ranks together (each attends to the earlier shards' keys); rank 0 prints.
Status RunPrefill(const Args& a, Engine& e, const Common& cm, int64_t S, Collective* group);

// Time to first token of a question about a document of S tokens (issue 17):
// a request of S document tokens + --question tokens, max_new_tokens 1,
// through Runtime::Generate. --cache off: cold (the whole prompt prefilled).
// --cache hbm: a first request with the same document and another question
// fills the prefix cache (its TTFT is reported as populate_ttft_ms), then the
// timed request attaches the document's KV state from device memory and
// prefills only its question. --cache disk: the same, with the prefix also
// stored on disk (--store-dir, emptied first, synced commits, O_DIRECT
// reads); before the timed request the device cache is cleared, as after a
// restart, so the document is read back from disk (restore_gb_per_s: stored
// bytes over the checked read's time).
Status RunTtft(const Args& a, Engine& e, const Common& cm, int64_t S);

// shared: --batch sequences over ONE copy of a document (the issue 17
// shared-document decode). The document (--context tokens, real prefill of
// synthetic ids) is prefilled once and captured; each sequence attaches it
// (SequenceSpec::prefix) and prefills its own --question tokens; then
// --steps decode steps of the whole batch are timed after 2 warm-up steps
// (with tier 0, after the steps that copy the document's values to the
// device), greedy sampling included. Reports device bytes per attached
// sequence and the prefix's device and host bytes.
Status RunShared(const Args& a, Engine& e, const Common& cm, int64_t S);

}  // namespace penumbra::bench
