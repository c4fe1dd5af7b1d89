// The specontext KV policy on the CPU backend (stories260K: 5 layers, 8
// query heads over 4 KV heads of 8 dimensions): with a budget above the
// context it is full attention, wherever its layers live (device or host
// memory) and however the prompt is prefilled; with a small one it attends
// to fewer tokens, reuses most of the last step's rows (elastic loading) and
// still generates; retrieval heads are read from their file and refused with
// a message naming what is wrong; foreign documents and shards it cannot hold are refused.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>

#include <gtest/gtest.h>

#include "tests/docs_util.h"
#include "tests/test_util.h"
#include "tests/worker/greedy_steps.h"
#include "tests/worker/model_test_util.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"
#include "worker/engine/specontext_head.h"

namespace penumbra {
namespace {

class SpeContextTest : public testing::StoriesTest {};

std::unique_ptr<Engine> Open(const EngineOptions& o) {
  auto e = Engine::Open(testing::StoriesDir(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

EngineOptions SpeContext(int budget, int local, int device_layers, const std::string& head = "random") {
  EngineOptions o;
  o.backend.device = "cpu";
  o.kv_policy = "specontext";
  o.specontext.budget = budget;
  o.specontext.local = local;
  o.specontext.device_layers = device_layers;
  o.specontext.head = head;
  return o;
}

struct GreedyRun {
  std::vector<int32_t> ids;
  std::vector<float> logits;  // the prefill's last row, then every step's
};

// Greedy: the prompt (in segments ending at `cuts`, each a prefill of its
// own), then `steps` decode steps.
GreedyRun Greedy(Engine& e, const std::vector<int32_t>& prompt, int steps, std::vector<int64_t> cuts = {}) {
  GreedyRun out;
  Runtime& rt = e.runtime();
  const int V = e.config().vocab_size;
  std::vector<float> logits;
  EXPECT_TRUE(rt.AddSequence(0, static_cast<int64_t>(prompt.size()), steps).ok());
  cuts.push_back(static_cast<int64_t>(prompt.size()));
  int64_t at = 0;
  for (int64_t cut : cuts) {
    const Status s = rt.Prefill(0, prompt, &logits, at, cut);
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) return out;
    at = cut;
  }
  out.logits.assign(logits.end() - V, logits.end());
  testing::GreedySteps(rt, V, &*(logits.end() - V), static_cast<int64_t>(prompt.size()), steps, &out.ids, &out.logits);
  rt.policy().RemoveSequence(0);
  return out;
}

const std::vector<int32_t> kPrompt = testing::LcgTokens(200, 5, true);

GreedyRun FullRun(int steps, std::vector<int64_t> cuts = {}) {
  EngineOptions o;
  o.backend.device = "cpu";
  auto e = Open(o);
  return e ? Greedy(*e, kPrompt, steps, std::move(cuts)) : GreedyRun{};
}

// A budget above the context: every earlier token is selected at every step
// (the top-k of fewer tokens than k), the local window holds the rest, and
// the attention is full attention's, with every layer in device memory, in
// host memory, split, or as the memory model places them.
TEST_F(SpeContextTest, ABudgetAboveTheContextIsFullAttention) {
  const GreedyRun full = FullRun(16);
  for (int device_layers : {0, 2, 5, -1}) {
    SCOPED_TRACE("device_layers " + std::to_string(device_layers));
    auto e = Open(SpeContext(256, 8, device_layers));
    ASSERT_TRUE(e);
    const GreedyRun r = Greedy(*e, kPrompt, 16);
    EXPECT_EQ(r.ids, full.ids);
    ASSERT_EQ(r.logits.size(), full.logits.size());
    EXPECT_TRUE(testing::AllClose(r.logits, full.logits, 1e-4f, 1e-4f));
    // Every selectable token selected at every step, all but the newly
    // selectable one already on the device after the first step.
    const PolicyStats s = e->runtime().policy().stats();
    EXPECT_EQ(s.decode_steps, 16);
    const int hkv = e->config().num_kv_heads;
    int64_t selected = 0;
    for (int i = 0; i < 16; ++i) selected += static_cast<int64_t>(kPrompt.size()) + i + 1 - 8;
    EXPECT_EQ(s.selected_chunks, selected * hkv);
    EXPECT_EQ(s.hit_chunks, (selected - (static_cast<int64_t>(kPrompt.size()) + 1 - 8) - 15) * hkv);
  }
}

// The observation window (the prompt's last queries' weights as a floor of
// every step's scores) and successors (a selected token brings the next
// ones) change which tokens are selected, never what a selection of every
// token gives: full attention.
TEST_F(SpeContextTest, AnObservationWindowAndSuccessorsKeepFullAttentionAtAFullBudget) {
  const GreedyRun full = FullRun(12);
  EngineOptions o = SpeContext(256, 8, 0);
  o.specontext.observe = 16;
  o.specontext.successors = 3;
  auto e = Open(o);
  ASSERT_TRUE(e);
  const GreedyRun r = Greedy(*e, kPrompt, 12, {120});
  EXPECT_EQ(r.ids, full.ids);
  EXPECT_TRUE(testing::AllClose(r.logits, full.logits, 1e-4f, 1e-4f));
  // A small budget: other tokens than without them, still finite.
  EngineOptions small = SpeContext(16, 4, 0), plain = SpeContext(16, 4, 0);
  small.specontext.observe = 16;
  small.specontext.successors = 3;
  auto es = Open(small), ep = Open(plain);
  ASSERT_TRUE(es && ep);
  const GreedyRun a = Greedy(*es, kPrompt, 8), b = Greedy(*ep, kPrompt, 8);
  for (float x : a.logits) ASSERT_TRUE(std::isfinite(x));
  float diff = 0;
  for (size_t i = 0; i < a.logits.size(); ++i) diff = std::max(diff, std::fabs(a.logits[i] - b.logits[i]));
  EXPECT_GT(diff, 1e-3f) << "the observation window and successors changed no selection";
}

// A prompt prefilled in three runs (a continuation reads the earlier rows
// back from the layers' stores) gives the same tokens as one prefill.
TEST_F(SpeContextTest, APromptPrefilledInRunsIsThePromptPrefilledAtOnce) {
  const GreedyRun full = FullRun(8);
  for (int device_layers : {0, 3}) {
    auto e = Open(SpeContext(256, 4, device_layers));
    ASSERT_TRUE(e);
    const GreedyRun r = Greedy(*e, kPrompt, 8, {70, 130});
    EXPECT_EQ(r.ids, full.ids);
    EXPECT_TRUE(testing::AllClose(r.logits, full.logits, 1e-4f, 1e-4f));
  }
}

// A budget of 16 of ~200 tokens: the steps attend to 16 + 4 rows per KV
// head, keep the rows of the last step's selection that this one selects
// again and copy only the rest; host and device stores give the same
// tokens; the generation stays finite and follows the model in part.
TEST_F(SpeContextTest, ASmallBudgetReusesRowsAndStillGenerates) {
  const GreedyRun full = FullRun(24);
  auto host = Open(SpeContext(16, 4, 0));
  auto device = Open(SpeContext(16, 4, 5));
  ASSERT_TRUE(host && device);
  const GreedyRun h = Greedy(*host, kPrompt, 24), d = Greedy(*device, kPrompt, 24);
  ASSERT_EQ(h.ids.size(), 25u);
  EXPECT_EQ(h.ids, d.ids);
  EXPECT_TRUE(testing::AllClose(h.logits, d.logits, 1e-5f, 1e-5f));
  for (float x : h.logits) ASSERT_TRUE(std::isfinite(x));
  EXPECT_TRUE(testing::AllClose(
      std::vector<float>(h.logits.begin(), h.logits.begin() + host->config().vocab_size),
      std::vector<float>(full.logits.begin(), full.logits.begin() + host->config().vocab_size), 1e-4f, 1e-4f))
      << "the prefill is exact";
  const PolicyStats s = host->runtime().policy().stats();
  EXPECT_EQ(s.selected_chunks, 24 * 16 * host->config().num_kv_heads);
  // A random head over random tokens: some of each step's rows were the last
  // step's (elastic loading reused them), not all.
  EXPECT_GT(s.hit_rate(), 0.05);
  EXPECT_LT(s.hit_rate(), 1.0);
  // A forced hit rate (benchmarks on random weights) keeps that share.
  ASSERT_TRUE(host->runtime().policy().SetForcedHitRate(0.75).ok());
  const PolicyStats before = host->runtime().policy().stats();
  (void)Greedy(*host, kPrompt, 8);
  const PolicyStats after = host->runtime().policy().stats();
  const double forced = static_cast<double>(after.hit_chunks - before.hit_chunks) /
                        static_cast<double>(after.selected_chunks - before.selected_chunks);
  // The first step starts from empty slots; later ones keep at least 12 of
  // the last 16 rows (more where the selection itself kept more).
  EXPECT_GE(forced, 0.75 * 7 / 8 - 0.01);
}

// What the selection is worth: leaving out one of the 193 selectable tokens
// (those of lowest head weight) moves the first step's logits a little,
// leaving out more moves them more, and attending to the local window alone
// (a budget of 1) most: the selected rows are the ones attended.
TEST_F(SpeContextTest, TheFewerTokensSelectedTheFurtherFromFullAttention) {
  const GreedyRun full = FullRun(1);
  const int V = 512;
  std::vector<float> diffs;
  for (int budget : {193, 192, 150, 100, 1}) {
    auto e = Open(SpeContext(budget, 8, 0));
    ASSERT_TRUE(e);
    const GreedyRun r = Greedy(*e, kPrompt, 1);
    ASSERT_EQ(r.logits.size(), full.logits.size());
    float m = 0;
    for (int i = V; i < 2 * V; ++i) m = std::max(m, std::fabs(r.logits[i] - full.logits[i]));
    diffs.push_back(m);
  }
  EXPECT_LT(diffs[0], 1e-4f) << "every selectable token selected";
  EXPECT_GT(diffs[1], diffs[0]);
  EXPECT_LT(diffs[1], 0.05f) << "one token of 193 left out";
  EXPECT_LT(diffs[1], diffs[2]);
  EXPECT_LT(diffs[2], diffs[3]);
  EXPECT_LT(diffs[1] * 20, diffs[4]) << "the local window alone is far from full attention";
}

// A head file as ops/evalmodel/train_specontext_head.py writes it.
struct HeadFile {
  int hidden = 64, heads = 8, kv_heads = 4, head_dim = 8, vocab = 512;
  std::string format = "penumbra-specontext-head v1", embedding = "target";
  bool drop_k = false;
  std::string Write(const testing::TempDir& dir, const std::string& name) const {
    std::vector<testing::TestTensor> t;
    t.push_back(testing::RampTensor("norm.weight", {hidden}, "BF16", 1.0f, 0.0f));
    t.push_back(testing::RampTensor("q_proj.weight", {heads * head_dim, hidden}, "BF16", -0.5f, 1e-3f));
    if (!drop_k) t.push_back(testing::RampTensor("k_proj.weight", {kv_heads * head_dim, hidden}, "BF16", 0.3f, -1e-3f));
    nlohmann::json meta = {{"format", format},
                           {"hidden_size", std::to_string(hidden)},
                           {"num_heads", std::to_string(heads)},
                           {"num_kv_heads", std::to_string(kv_heads)},
                           {"head_dim", std::to_string(head_dim)},
                           {"rope_theta", "10000"},
                           {"rms_norm_eps", "1e-5"},
                           {"vocab_size", std::to_string(vocab)},
                           {"trained_context", "256"},
                           {"embedding", embedding}};
    const std::string path = dir.File(name);
    testing::WriteStringToFile(path, testing::BuildSafetensors(t, meta));
    return path;
  }
};

TEST_F(SpeContextTest, AHeadFileIsReadAndAWrongOneRefusedByName) {
  testing::TempDir dir;
  HeadFile good;
  auto e = Open(SpeContext(16, 4, 0, good.Write(dir, "good.safetensors")));
  ASSERT_TRUE(e);
  const GreedyRun r = Greedy(*e, kPrompt, 6);
  EXPECT_EQ(r.ids.size(), 7u);
  // The model's directory's head by default: stories260K has none.
  {
    auto missing = Engine::Open(testing::StoriesDir(), SpeContext(16, 4, 0, ""));
    ASSERT_FALSE(missing.ok());
    EXPECT_HAS_SUBSTR(missing.status().message(), "specontext-head.safetensors");
  }
  struct Case {
    std::string what;
    HeadFile f;
  };
  std::vector<Case> bad;
  bad.push_back({"num_kv_heads 2 is not the model's 4", [] {
                   HeadFile f;
                   f.kv_heads = 2;
                   return f;
                 }()});
  bad.push_back({"hidden_size 32 is not the model's 64", [] {
                   HeadFile f;
                   f.hidden = 32;
                   return f;
                 }()});
  bad.push_back({"vocab_size 100 is not the model's 512", [] {
                   HeadFile f;
                   f.vocab = 100;
                   return f;
                 }()});
  bad.push_back({"no tensor 'k_proj.weight'", [] {
                   HeadFile f;
                   f.drop_k = true;
                   return f;
                 }()});
  bad.push_back({"metadata format is not", [] {
                   HeadFile f;
                   f.format = "something else";
                   return f;
                 }()});
  bad.push_back({"embedding must be 'target'", [] {
                   HeadFile f;
                   f.embedding = "own";
                   return f;
                 }()});
  bad.push_back({"num_heads 6 must be 1 to 8 times num_kv_heads 4", [] {
                   HeadFile f;
                   f.heads = 6;
                   return f;
                 }()});
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE(bad[i].what);
    auto opened =
        Engine::Open(testing::StoriesDir(), SpeContext(16, 4, 0, bad[i].f.Write(dir, std::to_string(i) + ".st")));
    ASSERT_FALSE(opened.ok());
    EXPECT_EQ(opened.status().code(), StatusCode::kInvalidArgument) << opened.status();
    EXPECT_HAS_SUBSTR(opened.status().message(), bad[i].what);
  }
  // Not a safetensors file at all.
  testing::WriteStringToFile(dir.File("junk"), "not a head");
  auto junk = Engine::Open(testing::StoriesDir(), SpeContext(16, 4, 0, dir.File("junk")));
  ASSERT_FALSE(junk.ok());
  EXPECT_HAS_SUBSTR(junk.status().message(), "specontext head");
}

// YaRN's frequencies: factor 1 is plain RoPE; above it the dimensions of long
// wavelength (fewer than one period in the trained context) are divided by the
// factor, the short ones (more than 32 periods) kept, the ramp between
// monotone; the temperature grows with the factor.
TEST(SpeContextYarn, FrequenciesAndTemperature) {
  const int d = 64;
  const std::vector<float> plain = YarnInvFreq(d, 10000.0, 1.0, 2048), yarn = YarnInvFreq(d, 10000.0, 8.0, 2048);
  ASSERT_EQ(plain.size(), 32u);
  for (int i = 0; i < 32; ++i) {
    EXPECT_FLOAT_EQ(plain[i], static_cast<float>(std::pow(10000.0, -2.0 * i / d)));
    const double periods = 2048 * plain[i] / (2 * M_PI);
    if (periods > 32) {
      EXPECT_FLOAT_EQ(yarn[i], plain[i]) << i;
    }
    if (periods < 1) {
      EXPECT_NEAR(yarn[i], plain[i] / 8, plain[i] * 1e-6) << i;
    }
    const double ratio = yarn[i] / plain[i];
    EXPECT_LE(ratio, 1.0 + 1e-6);
    EXPECT_GE(ratio, 1.0 / 8 - 1e-6);
    if (i > 0) {
      EXPECT_LE(ratio, yarn[i - 1] / plain[i - 1] + 1e-6) << "the ramp is monotone";
    }
  }
  EXPECT_DOUBLE_EQ(YarnMscale(1.0), 1.0);
  EXPECT_NEAR(YarnMscale(8.0), 0.1 * std::log(8.0) + 1.0, 1e-12);
}

// Shards are not held yet (Unimplemented); another policy's document, a
// capture past what a sequence holds, bad options and sequences longer than
// the policy holds are refused by name.
TEST_F(SpeContextTest, ShardsForeignDocumentsAndBadOptionsAreRefused) {
  auto e = Open(SpeContext(16, 4, 0));
  ASSERT_TRUE(e);
  KvPolicy& p = e->runtime().policy();
  // Context-parallel shards (tests/worker/context_parallel_test.cc): the
  // last one must hold the local window; no observation window.
  SequenceSpec shard;
  shard.prompt_len = 3;
  shard.max_new_tokens = 4;
  shard.shard.position_base = 64;
  const Status short_last = p.AddSequence(1, shard);
  EXPECT_EQ(short_last.code(), StatusCode::kInvalidArgument);
  EXPECT_HAS_SUBSTR(short_last.message(), "fewer than the local window");
  {
    EngineOptions o = SpeContext(16, 4, 0);
    o.specontext.observe = 2;
    auto observing = Open(o);
    ASSERT_TRUE(observing);
    shard.prompt_len = 64;
    const Status refused = observing->runtime().policy().AddSequence(1, shard);
    EXPECT_EQ(refused.code(), StatusCode::kUnimplemented);
    EXPECT_HAS_SUBSTR(refused.message(), "specontext.observe");
  }
  // Longer than the slot update's bitmap holds (with a budget of 16).
  const Status too_long = p.AddSequence(3, 950000, 4);
  EXPECT_EQ(too_long.code(), StatusCode::kInvalidArgument);
  EXPECT_HAS_SUBSTR(too_long.message(), "at most 928768");
  // A document is captured, and again from a sequence attached to it;
  // another policy's document is refused.
  ASSERT_TRUE(p.AddSequence(2, 64, 4).ok());
  std::vector<float> logits;
  ASSERT_TRUE(e->runtime().Prefill(2, testing::LcgTokens(64, 3, true), &logits).ok());
  auto doc = p.CapturePrefix(2, 64);
  ASSERT_TRUE(doc.ok()) << doc.status();
  EXPECT_EQ((*doc)->policy(), "specontext");
  EXPECT_EQ((*doc)->tokens(), 64);
  SequenceSpec attached;
  attached.prompt_len = 70;
  attached.max_new_tokens = 2;
  attached.prefix = *doc;
  ASSERT_TRUE(p.AddSequence(4, attached).ok());
  auto again = p.CapturePrefix(4, 40);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->tokens(), 40);
  EXPECT_EQ(p.CapturePrefix(4, 65).status().code(), StatusCode::kInvalidArgument);
  p.RemoveSequence(4);
  // A whole prompt's document is not a shard's, nor one shard's another's.
  SequenceSpec as_shard;
  as_shard.prompt_len = 64;
  as_shard.shard.position_base = 64;
  as_shard.shard.closed = true;
  as_shard.prefix = *doc;
  const Status moved = p.AddSequence(9, as_shard);
  EXPECT_EQ(moved.code(), StatusCode::kInvalidArgument);
  EXPECT_HAS_SUBSTR(moved.message(), "from position 0 attached at position 64");
  p.RemoveSequence(2);
  EngineOptions fo;
  fo.backend.device = "cpu";
  auto full = Open(fo);
  ASSERT_TRUE(full);
  ASSERT_TRUE(full->runtime().policy().AddSequence(5, 64, 2).ok());
  ASSERT_TRUE(full->runtime().Prefill(5, testing::LcgTokens(64, 3, true), &logits).ok());
  auto foreign = full->runtime().policy().CapturePrefix(5, 64);
  ASSERT_TRUE(foreign.ok());
  attached.prefix = *foreign;
  EXPECT_EQ(p.AddSequence(6, attached).code(), StatusCode::kInvalidArgument);
  for (auto [key, value] : {std::pair<std::string, int>{"budget", 0}, {"local", 0}}) {
    EngineOptions o = SpeContext(16, 4, 0);
    (key == "budget" ? o.specontext.budget : o.specontext.local) = value;
    auto bad = Engine::Open(testing::StoriesDir(), o);
    ASSERT_FALSE(bad.ok());
    EXPECT_HAS_SUBSTR(bad.status().message(), key);
  }
}

// docs/kv-policies.md's table of the options is the option table's own.
TEST(SpeContextOptions, TheDocsTableIsTheOptionTable) {
  EXPECT_TRUE(
      testing::GeneratedDocSectionIs("docs/kv-policies.md", "specontext options", SpeContextOptionTable().Markdown()));
}

}  // namespace
}  // namespace penumbra
