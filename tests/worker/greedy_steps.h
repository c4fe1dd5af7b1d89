// The greedy decode loop the policy tests share (specontext_policy_test,
// spindlekv_policy_test, and DeviceGreedy of small_gpu_model.h for the GPU
// tests).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "worker/engine/runtime.h"

namespace penumbra::testing {

// Sequence 0 of `rt`, prefilled through position start - 1, whose prefill's
// last row of logits is `last` (host, `vocab` floats): its greedy pick goes
// to *ids, then `steps` decode steps at positions start, start + 1, ...,
// each step's logits (read back from the backend's memory) appended to
// *logits and its pick to *ids. Stops at the first failed step.
inline void GreedySteps(Runtime& rt, int vocab, const float* last, int64_t start, int steps, std::vector<int32_t>* ids,
                        std::vector<float>* logits) {
  int32_t tok = static_cast<int32_t>(std::max_element(last, last + vocab) - last);
  ids->push_back(tok);
  std::vector<float> host(static_cast<size_t>(vocab));
  for (int i = 0; i < steps; ++i) {
    auto l = rt.DecodeStep({0}, {tok}, {start + i});
    EXPECT_TRUE(l.ok()) << l.status();
    if (!l.ok()) return;
    EXPECT_TRUE(rt.backend().CopyToHost(host.data(), *l, host.size() * sizeof(float)).ok());
    logits->insert(logits->end(), host.begin(), host.end());
    tok = static_cast<int32_t>(std::max_element(host.begin(), host.end()) - host.begin());
    ids->push_back(tok);
  }
}

}  // namespace penumbra::testing
