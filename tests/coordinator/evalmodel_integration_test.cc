// The shipped evaluation model (models/penumbra-eval, docs/evalmodel.md) on two
// 4K records of its task suite, on the CPU backend, under both KV policies:
// an accuracy regression in the runtime, the tokenizer or ShadowKV shows here
// without a GPU. The records (tests/data/evaltasks/evalmodel_4k.jsonl) are the
// first niah_single and kv records of the 4K set made with the model's own
// tokenizer; Hugging Face transformers answered both correctly.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "coordinator/cli/eval.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "tests/test_util.h"
#include "worker/engine/engine.h"

namespace penumbra {
namespace {

std::string ModelDir() { return testing::SourceDir() + "/models/penumbra-eval"; }

struct Outcome {
  std::vector<std::string> predictions;
  std::vector<bool> correct;
  double hit_rate = 0;
};

Outcome RunRecords(const EngineOptions& o) {
  Outcome out;
  auto tok = Tokenizer::FromFile(ModelDir() + "/tokenizer.json");
  EXPECT_TRUE(tok.ok()) << tok.status();
  auto e = Engine::Open(ModelDir(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  auto recs = LoadEvalRecords(testing::SourceDir() + "/tests/data/evaltasks/evalmodel_4k.jsonl");
  EXPECT_TRUE(recs.ok()) << recs.status();
  if (!tok.ok() || !e.ok() || !recs.ok()) return out;
  EXPECT_EQ(recs->size(), 2u);
  auto runner = EvalRunner::Create(&(*e)->runtime(), tok->get(), (*e)->config().eos_token_ids);
  EXPECT_TRUE(runner.ok()) << runner.status();
  if (!runner.ok()) return out;
  for (const EvalRecord& r : *recs) {
    auto enc = (*runner)->Encode(r);
    EXPECT_TRUE(enc.ok()) << enc.status();
    if (!enc.ok()) return out;
    auto res = (*runner)->Run(*enc, r.max_new_tokens);
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) return out;
    const std::string& p = (*res)[0].prediction;
    out.predictions.push_back(p);
    out.correct.push_back(ScorePrediction(p, r.answer).correct);
  }
  out.hit_rate = (*e)->runtime().policy().stats().hit_rate();
  return out;
}

TEST(EvalModelTest, FullAttentionAnswersBothRecords) {
  EngineOptions o;
  o.backend.device = "cpu";
  const Outcome r = RunRecords(o);
  ASSERT_EQ(r.correct.size(), 2u);
  EXPECT_TRUE(r.correct[0]) << "niah_single predicted " << r.predictions[0];
  EXPECT_TRUE(r.correct[1]) << "kv predicted " << r.predictions[1];
}

// ShadowKV with rank 40 of 256 (16%), chunk 8, outliers 0.3% of the chunks
// and a 6.25% budget (at the paper's 1.56% this model loses the needle at 4K;
// docs/evalmodel.md has the sweep).
EngineOptions SparseOptions() {
  EngineOptions o;
  o.backend.device = "cpu";
  o.kv_policy = "shadowkv";
  o.shadowkv.rank = 40;
  o.shadowkv.chunk_size = 8;
  o.shadowkv.budget_fraction = 0.0625;
  o.shadowkv.outlier_fraction = 0.003;
  o.shadowkv.min_prompt_tokens = 1024;
  return o;
}

// The paper's selection (one landmark per chunk): the needle must be found;
// the UUID copy of the kv record fails under every sparse budget this model
// was measured at (docs/evalmodel.md), so only its first 8 characters — found
// before the selection loses track — are checked.
TEST(EvalModelTest, ShadowKvWithThePapersLandmarkFindsTheNeedle) {
  EngineOptions o = SparseOptions();
  o.shadowkv.landmarks_per_chunk = 1;
  const Outcome r = RunRecords(o);
  ASSERT_EQ(r.correct.size(), 2u);
  EXPECT_TRUE(r.correct[0]) << "niah_single predicted " << r.predictions[0];
  EXPECT_EQ(r.predictions[1].substr(0, 8), "d85b02ee") << "kv predicted " << r.predictions[1];
  // The sparse path really ran: chunks were selected and some were hits.
  EXPECT_GT(r.hit_rate, 0.0);
}

// The same with the defaults: four landmarks per chunk
// (shadowkv.landmarks_per_chunk, issue 20), stored as fp8: a chunk scores as
// its best run of 2 keys instead of the mean of 8, and the UUID is copied
// exactly (with one landmark per chunk it goes astray after its first group;
// with two, one character is wrong: measured on this machine).
TEST(EvalModelTest, ShadowKvWithTheDefaultFourLandmarksPerChunkCopiesTheUuid) {
  const EngineOptions o = SparseOptions();
  ASSERT_EQ(o.shadowkv.landmarks_per_chunk, 4);
  ASSERT_EQ(o.shadowkv.landmark_format, "fp8");
  const Outcome r = RunRecords(o);
  ASSERT_EQ(r.correct.size(), 2u);
  EXPECT_TRUE(r.correct[0]) << "niah_single predicted " << r.predictions[0];
  EXPECT_TRUE(r.correct[1]) << "kv predicted " << r.predictions[1];
  EXPECT_GT(r.hit_rate, 0.0);
}

// The same with the landmarks in the model's dtype (f32 here) instead of the
// default fp8 records (shadowkv.landmark_format: e4m3 codes and a scale per
// chunk, half the bytes of bf16): the two copy the UUID alike.
TEST(EvalModelTest, ShadowKvWithLandmarksInTheModelsDtypeCopiesTheUuid) {
  EngineOptions o = SparseOptions();
  o.shadowkv.landmark_format = "model";
  const Outcome r = RunRecords(o);
  ASSERT_EQ(r.correct.size(), 2u);
  EXPECT_TRUE(r.correct[0]) << "niah_single predicted " << r.predictions[0];
  EXPECT_TRUE(r.correct[1]) << "kv predicted " << r.predictions[1];
  EXPECT_GT(r.hit_rate, 0.0);
}

// With the offloaded values stored as fp8 (shadowkv.value_format: e4m3
// codes and a scale per token, about half the bytes of bf16; the prompt's
// values encoded when offloaded, the generated chunks' when they close),
// the answers are the same.
TEST(EvalModelTest, ShadowKvWithFp8ValuesCopiesTheUuid) {
  EngineOptions o = SparseOptions();
  o.shadowkv.value_format = "fp8";
  const Outcome r = RunRecords(o);
  ASSERT_EQ(r.correct.size(), 2u);
  EXPECT_TRUE(r.correct[0]) << "niah_single predicted " << r.predictions[0];
  EXPECT_TRUE(r.correct[1]) << "kv predicted " << r.predictions[1];
  EXPECT_GT(r.hit_rate, 0.0);
}

// SpeContext with the retrieval head shipped beside the model
// (specontext-head.safetensors, distilled by
// ops/evalmodel/train_specontext_head.py, read by default) and the default
// options: 2048 tokens per KV head, each bringing its next 16, a local window
// of 128: both records answered. With the paper's tokens alone (no
// successors) neither is (docs/kv-policies.md, "specontext").
TEST(EvalModelTest, SpeContextWithTheShippedHeadAnswersBothRecords) {
  EngineOptions o;
  o.backend.device = "cpu";
  o.kv_policy = "specontext";
  const Outcome r = RunRecords(o);
  ASSERT_EQ(r.correct.size(), 2u);
  EXPECT_TRUE(r.correct[0]) << "niah_single predicted " << r.predictions[0];
  EXPECT_TRUE(r.correct[1]) << "kv predicted " << r.predictions[1];
  EXPECT_GT(r.hit_rate, 0.5) << "adjacent steps' selections";
}

}  // namespace
}  // namespace penumbra
