// Engine options shared by the worker tests that run ShadowKV on the small
// real model (stories260K, from ../shared/models).
#pragma once

#include <string>

#include "tests/test_util.h"
#include "worker/engine/engine.h"

namespace penumbra::testing {

inline std::string StoriesDir() { return SharedDir() + "/models/stories260K"; }

// CPU engine, sparse and lossy on stories260K (hkv*d = 32): prompts of ~150
// tokens have ~35 chunks of 4; 2 outliers and 6 selected chunks per KV head, a
// window of 8, so generated tokens become chunks every 4 steps.
inline EngineOptions LossyShadowKvOptions() {
  EngineOptions o;
  o.backend.device = "cpu";
  o.kv_policy = "shadowkv";
  o.shadowkv.rank = 12;
  o.shadowkv.chunk_size = 4;
  o.shadowkv.budget_tokens = 24;
  o.shadowkv.outlier_chunks = 2;
  o.shadowkv.local_window = 8;
  o.shadowkv.min_prompt_tokens = 0;
  return o;
}

}  // namespace penumbra::testing
