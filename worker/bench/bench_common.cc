// What the modes share: the policy's fields of a line, --profile's per-op timing.
#include "worker/bench/bench.h"

#include <string>

#include "worker/engine/op_profiler.h"

namespace penumbra::bench {

void AddPolicy(const EngineOptions& o, nlohmann::json& j) {
  j["kv_policy"] = o.kv_policy;
  if (o.kv_policy != "shadowkv") return;
  j["chunk_size"] = o.shadowkv.chunk_size;
  j["landmarks_per_chunk"] = o.shadowkv.landmarks_per_chunk;
  j["landmark_format"] = o.shadowkv.landmark_format;
  j["value_format"] = o.shadowkv.value_format;
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
