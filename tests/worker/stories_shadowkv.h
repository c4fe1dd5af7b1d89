// What the worker tests that run the small real model (stories260K, shipped
// in tests/data/models/stories260K) share: a fixture that fails the test with
// one line when the model is missing, and the lossy ShadowKV options.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tests/test_util.h"
#include "worker/engine/engine.h"

namespace penumbra::testing {

// Tests on stories260K: SetUp fails (one line per missing file) unless the
// model and its golden are there.
class StoriesTest : public DataTest {
 protected:
  std::vector<std::string> RequiredData() const override {
    return {StoriesDir() + "/config.json", StoriesDir() + "/model.safetensors", StoriesDir() + "/golden_greedy.json"};
  }
};

// n token ids from a fixed LCG (3..502, inside stories260K's vocabulary),
// after a BOS (1) when `bos`: documents and questions for tests.
inline std::vector<int32_t> LcgTokens(int n, uint64_t seed, bool bos) {
  std::vector<int32_t> t;
  if (bos) t.push_back(1);
  uint64_t x = seed;
  while (static_cast<int>(t.size()) < n) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    t.push_back(static_cast<int32_t>(3 + (x >> 33) % 500));
  }
  return t;
}

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
  // Two landmarks per chunk of 4 (runs of 2 keys): the several-landmark path
  // of the default (4, which at chunks of 4 would make each landmark one key).
  o.shadowkv.landmarks_per_chunk = 2;
  // The dense continuation (exact at full rank): tests of the sparse one say so.
  o.shadowkv.continuation = "dense";
  return o;
}

// ShadowKV that loses nothing on stories260K: full rank (hkv * d = 32), no
// outliers and a budget above every chunk (every chunk selected, its keys
// rebuilt from the factors with RoPE at their positions). Chunks of 32 with
// a window of 8: a 300-token prompt and its 64-aligned context-parallel
// shards end with 12 local tokens, so up to 27 new tokens make no new chunk
// (a chunk made while decoding would take a slot from the prompt's: no
// longer exact). The context-parallel tests' exact configuration.
inline EngineOptions ExactShadowKvOptions() {
  EngineOptions o = LossyShadowKvOptions();
  o.shadowkv.rank = 32;
  o.shadowkv.chunk_size = 32;
  o.shadowkv.local_window = 8;
  o.shadowkv.outlier_chunks = 0;
  o.shadowkv.budget_tokens = 4096;
  return o;
}

// Lossy ShadowKV (6 of ~70 chunks of 4 selected per KV head of a 300-token
// prompt) whose context-parallel shards hold exactly what the unsharded
// sequence holds: full rank (the rebuilt keys are the exact ones), no
// outliers (a shard would pick its own), shard boundaries at multiples of 64
// (chunk boundaries; a closed shard has no local window). With the global
// selection the shards agree on the unsharded top-k every step, so sharded
// and unsharded give the same greedy tokens.
inline EngineOptions GlobalSelectionShadowKvOptions() {
  EngineOptions o = LossyShadowKvOptions();
  o.runtime.prefill_chunk = 48;
  o.shadowkv.rank = 32;  // hkv * d: full rank
  o.shadowkv.outlier_chunks = 0;
  o.shadowkv.shard_selection = "global";
  return o;
}

}  // namespace penumbra::testing
