// What the engine-level GPU tests of the sparse policies share
// (spindlekv_gpu_test, specontext_gpu_test): a small model of random weights
// with the kernels' head size (64), a deterministic prompt, and a greedy run
// reading the logits back from the device.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "tests/worker/greedy_steps.h"
#include "worker/engine/engine.h"

namespace penumbra::testing {

// 3 layers, 8 query heads over 2 KV heads of 64.
inline ModelConfig SmallGpuModel() {
  ModelConfig c;
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.num_layers = 3;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.vocab_size = 512;
  c.max_position_embeddings = 8192;
  c.rope_theta = 10000.0;
  return c;
}

// n ids in [3, 503) from a fixed LCG.
inline std::vector<int32_t> GpuPrompt(int n) {
  std::vector<int32_t> p(n);
  uint64_t x = 12345;
  for (int& t : p) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    t = static_cast<int32_t>(3 + (x >> 33) % 500);
  }
  return p;
}

struct DeviceGreedyRun {
  std::vector<int32_t> ids;   // the prefill's pick, then each step's
  std::vector<float> logits;  // each decode step's
};

// Greedy on sequence 0: the prompt's prefill, then `steps` decode steps.
inline DeviceGreedyRun DeviceGreedy(Engine& e, const std::vector<int32_t>& prompt, int steps) {
  DeviceGreedyRun out;
  Runtime& rt = e.runtime();
  EXPECT_TRUE(rt.AddSequence(0, static_cast<int64_t>(prompt.size()), steps).ok());
  std::vector<float> logits;
  Status s = rt.Prefill(0, prompt, &logits);
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return out;
  const int V = e.config().vocab_size;
  GreedySteps(rt, V, &*(logits.end() - V), static_cast<int64_t>(prompt.size()), steps, &out.ids, &out.logits);
  rt.RemoveSequence(0);
  return out;
}

}  // namespace penumbra::testing
