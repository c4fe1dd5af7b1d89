// What the modes share: the policy's fields of a line, --kernel-trace's file,
// --profile's per-op timing.
#include "worker/bench/bench.h"

#include <string>
#include <vector>

#include "worker/engine/op_profiler.h"

namespace penumbra::bench {

void AddPolicy(const EngineOptions& o, nlohmann::json& j) {
  j["kv_policy"] = o.kv_policy;
  if (o.kv_policy == "spindlekv") {
    j["reserve_ratio"] = o.spindlekv.reserve_ratio;
    j["min_ratio"] = o.spindlekv.min_ratio;
    j["window"] = o.spindlekv.window;
    j["pool"] = o.spindlekv.pool;
    j["key_threshold"] = o.spindlekv.key_threshold;
    j["value_threshold"] = o.spindlekv.value_threshold;
    j["codebook_block"] = o.spindlekv.codebook_block;
    j["merge_window"] = o.spindlekv.merge_window;
    return;
  }
  if (o.kv_policy == "specontext") {
    j["budget"] = o.specontext.budget;
    j["local"] = o.specontext.local;
    j["observe"] = o.specontext.observe;
    j["successors"] = o.specontext.successors;
    j["head"] = o.specontext.head.empty() ? "model" : o.specontext.head;
    j["device_layers"] = o.specontext.device_layers;
    j["yarn_factor"] = o.specontext.yarn_factor;
    return;
  }
  if (o.kv_policy != "shadowkv") return;
  j["chunk_size"] = o.shadowkv.chunk_size;
  j["landmarks_per_chunk"] = o.shadowkv.landmarks_per_chunk;
  j["landmark_format"] = o.shadowkv.landmark_format;
  j["value_format"] = o.shadowkv.value_format;
}

Result<std::string> KernelTracePath(const Args& a, const Backend& b) {
  if (!a.Has("kernel-trace")) return std::string();
  const std::string path = a.Get("kernel-trace", "");
  if (path.empty()) return Status::InvalidArgument("--kernel-trace needs a file path");
  if (b.device() != Device::kCUDA) {
    return Status::InvalidArgument("--kernel-trace traces the CUDA backend's kernels: use --device cuda");
  }
  return path;
}

Status FinishKernelTrace(KernelTrace& trace, const std::string& path, nlohmann::json& j) {
  PENUMBRA_ASSIGN_OR_RETURN(std::vector<TraceRecord> recs, trace.Stop());
  PENUMBRA_RETURN_IF_ERROR(KernelTrace::Write(recs, path));
  j["kernel_trace"] = path;
  j["kernel_trace_records"] = recs.size();
  return Status::OK();
}

Status ProfileSteps(Backend& b, Runtime& rt, const std::function<Status()>& step, std::map<std::string, double>* ms) {
  OpProfiler prof(&b);
  rt.SetDecodeProfiler(&prof);
  Status st;
  for (int i = 0; i < kProfileSteps && st.ok(); ++i) {
    st = step();
    prof.Lap("sample");
  }
  rt.SetDecodeProfiler(nullptr);
  *ms = prof.ms();
  return st;
}

void AddProfile(const std::map<std::string, double>& ms, nlohmann::json& j) {
  double total = 0;
  for (const auto& [op, t] : ms) {
    j["decode_op_ms"][op] = t / kProfileSteps;
    total += t / kProfileSteps;
  }
  j["profiled_ms_per_step"] = total;
}

}  // namespace penumbra::bench
