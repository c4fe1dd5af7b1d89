// What the CPU and CUDA tests of a tier-0 copy freed mid-decode share
// (prefix_reuse_test's ShadowKvTier0Test, prefix_reuse_gpu_test's twin).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "worker/engine/document_cache.h"
#include "worker/engine/runtime.h"
#include "worker/engine/shadowkv_prefix.h"

namespace penumbra::testing {

// Greedy ids of question `r` (attached to `doc`, whose values are in tier 0)
// as sequence `seq` of `rt`, step by step: BeginPrefill and PrefillSteps,
// then decode steps; before the one that would make the `release_at`-th
// token, tier 0 is released (the copy freed while the question reads it in
// place). `res` gets the prefill's result. The sequence is removed at the
// end; a failed step fails the test and ends the ids there.
inline std::vector<int32_t> GreedyReleasingTier0(Runtime& rt, const ShadowKvPrefix& doc, const GenerationRequest& r,
                                                 int64_t seq, size_t release_at, GenerationResult* res) {
  const int64_t P = static_cast<int64_t>(r.prompt.size());
  Runtime::PrefillState st;
  std::vector<int32_t> ids;
  const Status begun = rt.BeginPrefill(seq, r, &st, res);
  EXPECT_TRUE(begun.ok()) << begun;
  if (!begun.ok()) return ids;
  for (;;) {
    auto done = rt.PrefillStep(seq, r, &st, 1 << 20);
    EXPECT_TRUE(done.ok()) << done.status();
    if (!done.ok()) return ids;
    if (*done) break;
  }
  // Logits are device memory on CUDA: copied to the host for the argmax.
  std::vector<float> logits(static_cast<size_t>(rt.config().vocab_size));
  auto greedy = [&](const float* dev) {
    EXPECT_TRUE(rt.backend().CopyToHost(logits.data(), dev, logits.size() * sizeof(float)).ok());
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  };
  ids.push_back(greedy(rt.LastLogits()));
  while (static_cast<int>(ids.size()) < r.max_new_tokens) {
    if (ids.size() == release_at) {
      EXPECT_TRUE(doc.values_on_device(0));  // read in place so far
      EXPECT_GT(rt.document_cache()->tier0()->Release(SIZE_MAX), 0u);
      EXPECT_FALSE(doc.values_on_device(0));
    }
    auto l = rt.DecodeStep({seq}, {ids.back()}, {P + static_cast<int64_t>(ids.size()) - 1});
    EXPECT_TRUE(l.ok()) << l.status();
    if (!l.ok()) break;
    ids.push_back(greedy(*l));
  }
  rt.policy().RemoveSequence(seq);
  return ids;
}

}  // namespace penumbra::testing
