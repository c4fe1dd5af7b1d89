// What the modes share: --profile's per-op timing.
#include "worker/bench/bench.h"

#include <string>

#include "worker/engine/op_profiler.h"

namespace penumbra::bench {

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
