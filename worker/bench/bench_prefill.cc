// penumbra-bench prefill: a prompt's prefill timed (with --cp-world, by the
// ranks of a context group together).
#include "worker/bench/bench.h"

#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

namespace penumbra::bench {

Status RunPrefill(const Args& a, Engine& e, const Common& cm, int64_t S, Collective* group) {
  Runtime& rt = e.runtime();
  std::vector<int32_t> prompt(S);
  for (int64_t i = 0; i < S; ++i) prompt[i] = static_cast<int32_t>((i * 7919) % e.config().vocab_size);
  PENUMBRA_RETURN_IF_ERROR(rt.AddSequence(0, S, 1));
  // Warm-up on a short prompt so handles and kernels are loaded.
  std::vector<int32_t> warm(prompt.begin(), prompt.begin() + std::min<int64_t>(S, 1024));
  PENUMBRA_RETURN_IF_ERROR(rt.AddSequence(1, warm.size(), 1));
  PENUMBRA_RETURN_IF_ERROR(rt.Prefill(1, warm, nullptr));
  rt.RemoveSequence(1);
  if (a.Has("profile")) rt.policy().SetProfiling(true);
  if (group) PENUMBRA_RETURN_IF_ERROR(group->Barrier());
  const double t0 = NowSeconds();
  PENUMBRA_RETURN_IF_ERROR(rt.Prefill(0, prompt, nullptr));
  PENUMBRA_RETURN_IF_ERROR(e.backend().Synchronize());
  if (group) PENUMBRA_RETURN_IF_ERROR(group->Barrier());
  const double dt = NowSeconds() - t0;
  if (group && group->rank() != 0) {
    rt.RemoveSequence(0);
    return Status::OK();
  }
  nlohmann::json j = cm.Line("prefill");
  j["gpus"] = group ? group->world() : 1;
  AddPolicy(e.options(), j);
  j["context"] = S;
  j["batch"] = 1;
  j["seconds"] = dt;
  j["prefill_chunk"] = e.options().runtime.prefill_chunk;
  if (group) j["cp_prefill_balance"] = e.options().runtime.cp_prefill_balance;
  if (a.Has("profile")) {
    double ops = 0;
    for (const auto& [op, ms] : rt.policy().stats().prefill_op_ms) {
      j["prefill_op_ms"][op] = ms;
      ops += ms;
    }
    j["compression_fraction"] = ops / 1e3 / dt;
  }
  std::cout << j.dump() << std::endl;
  rt.RemoveSequence(0);
  return Status::OK();
}

}  // namespace penumbra::bench
