// The spindlekv KV policy on the CPU backend (stories260K: 5 layers, 8 query
// heads over 4 KV heads of 8 dimensions): with every token kept and nothing
// shared it is full attention; lossy settings evict and share (less memory)
// and still generate; each query head keeps its own tokens; what a sequence
// holds after a decode step is what the paper's rules make of it; bad
// options, shards and foreign prefixes are refused. Prefix reuse (documents
// captured, attached, exported, stored) runs in prefix_reuse_test's suite.
#include <algorithm>
#include <cmath>
#include <cstring>

#include <gtest/gtest.h>

#include "common/config.h"
#include "tests/docs_util.h"
#include "tests/test_util.h"
#include "tests/worker/greedy_steps.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"
#include "worker/engine/spindlekv_math.h"
#include "worker/engine/spindlekv_options.h"

namespace penumbra {
namespace {

class SpindleKvTest : public testing::StoriesTest {};

std::unique_ptr<Engine> Open(const EngineOptions& o) {
  auto e = Engine::Open(testing::StoriesDir(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

EngineOptions Spindle(double ratio, double key_threshold, double value_threshold) {
  EngineOptions o;
  o.backend.device = "cpu";
  o.kv_policy = "spindlekv";
  o.spindlekv.reserve_ratio = ratio;
  o.spindlekv.window = 16;
  o.spindlekv.key_threshold = key_threshold;
  o.spindlekv.value_threshold = value_threshold;
  return o;
}

// Greedy: the prompt's prefill, then `steps` decode steps; the ids and every
// step's logits.
struct GreedyRun {
  std::vector<int32_t> ids;
  std::vector<float> logits;
  size_t bytes_after_prefill = 0;
};

// With first > 0 the prompt's first `first` tokens are its first prefill
// (as a document's) and the rest a continuation.
GreedyRun Greedy(Engine& e, const std::vector<int32_t>& prompt, int steps, int64_t first = 0) {
  GreedyRun out;
  Runtime& rt = e.runtime();
  std::vector<float> logits;
  Status s;
  if (first > 0) {
    SequenceSpec spec;
    spec.prompt_len = static_cast<int64_t>(prompt.size());
    spec.max_new_tokens = steps;
    spec.first_prefill = first;
    EXPECT_TRUE(rt.policy().AddSequence(0, spec).ok());
    s = rt.Prefill(0, prompt, nullptr, 0, first);
    if (s.ok()) s = rt.Prefill(0, prompt, &logits, first);
  } else {
    EXPECT_TRUE(rt.AddSequence(0, static_cast<int64_t>(prompt.size()), steps).ok());
    s = rt.Prefill(0, prompt, &logits);
  }
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return out;
  out.bytes_after_prefill = rt.policy().DeviceBytes(0);
  const int V = e.config().vocab_size;
  testing::GreedySteps(rt, V, &*(logits.end() - V), static_cast<int64_t>(prompt.size()), steps, &out.ids, &out.logits);
  rt.policy().RemoveSequence(0);
  return out;
}

const std::vector<int32_t> kPrompt = testing::LcgTokens(200, 5, true);

// r = 1 keeps every token in every layer; thresholds above 1 give every key
// and value an entry of its own (unit vector x magnitude): attention over
// the reconstruction is full attention up to f32 rounding.
TEST_F(SpindleKvTest, EverythingKeptAndNothingSharedIsFullAttention) {
  EngineOptions full;
  full.backend.device = "cpu";
  auto ef = Open(full);
  auto es = Open(Spindle(1.0, 1.5, 1.5));
  ASSERT_TRUE(ef && es);
  const GreedyRun a = Greedy(*ef, kPrompt, 12), b = Greedy(*es, kPrompt, 12);
  EXPECT_EQ(a.ids, b.ids);
  ASSERT_EQ(a.logits.size(), b.logits.size());
  EXPECT_TRUE(testing::AllClose(b.logits, a.logits, 1e-4f, 1e-4f));
}

// A lossy configuration: the pyramid keeps 30% of the context over the
// layers and similar keys and values share entries. It holds less than the
// exact cache would, and its tokens still follow the model (most of the
// greedy ids of full attention on a prompt the model continues well).
TEST_F(SpindleKvTest, LossySettingsHoldLessAndStillGenerate) {
  auto ef = Open([] {
    EngineOptions o;
    o.backend.device = "cpu";
    return o;
  }());
  auto lossless = Open(Spindle(1.0, 1.5, 1.5));
  auto lossy = Open(Spindle(0.3, 0.9, 0.9));
  ASSERT_TRUE(ef && lossless && lossy);
  const GreedyRun f = Greedy(*ef, kPrompt, 16), l0 = Greedy(*lossless, kPrompt, 16), l = Greedy(*lossy, kPrompt, 16);
  ASSERT_EQ(l.ids.size(), 17u);
  EXPECT_LT(l.bytes_after_prefill * 2, l0.bytes_after_prefill);
  for (float x : l.logits) ASSERT_TRUE(std::isfinite(x));
  int same = 0;
  for (size_t i = 0; i < f.ids.size(); ++i) same += f.ids[i] == l.ids[i];
  EXPECT_GT(same, 0) << "no greedy id in common with full attention";
  // The lossless run's bytes: per layer and KV head every token with its
  // own key and value entries (2 d floats), its position, references,
  // magnitudes and query-head mask (24 bytes).
  const ModelConfig& c = lossless->config();
  const size_t d = c.head_dim, T = kPrompt.size();
  const size_t per_layer = c.num_kv_heads * T * (2 * d * 4 + 24);
  EXPECT_EQ(l0.bytes_after_prefill, per_layer * c.num_layers);
  // The policy's measure of the reserve ratio (compressed bytes over the
  // exact cache's for the same tokens): above 1 with nothing dropped (the
  // references and lists cost bytes), below one half lossy.
  const PolicyStats s0 = lossless->runtime().policy().stats(), s = lossy->runtime().policy().stats();
  EXPECT_EQ(s0.kv_exact_bytes, static_cast<int64_t>(2 * 4 * c.num_kv_heads * T * d * c.num_layers));
  EXPECT_EQ(s0.kv_kept_bytes, static_cast<int64_t>(l0.bytes_after_prefill));
  EXPECT_GT(s0.kv_kept_bytes, s0.kv_exact_bytes);
  EXPECT_EQ(s.kv_exact_bytes, s0.kv_exact_bytes);
  EXPECT_LT(s.kv_kept_bytes * 2, s.kv_exact_bytes);
}

// The policy with its state in device memory (what CUDA runs) on the CPU
// backend: the same ops over the same f32 math as the host policy, so the
// same tokens, logits and compressed bytes, lossless and lossy, for a whole
// prompt and for a first segment and a continuation, new tokens searching
// the whole codebook or its last 8 entries.
TEST_F(SpindleKvTest, TheDeviceStatePolicyIsTheHostPolicy) {
  struct Setting {
    double ratio, threshold;
    int64_t merge_window;
  };
  for (const Setting& c : {Setting{1.0, 1.5, 0}, Setting{0.3, 0.9, 0}, Setting{0.3, 0.9, 8}}) {
    for (int64_t first : {int64_t{0}, int64_t{150}}) {
      SCOPED_TRACE("ratio " + std::to_string(c.ratio) + ", merge window " + std::to_string(c.merge_window) +
                   ", first prefill " + std::to_string(first));
      EngineOptions host = Spindle(c.ratio, c.threshold, c.threshold);
      host.spindlekv.merge_window = c.merge_window;
      EngineOptions device = host;
      device.spindlekv_device_state = true;
      auto eh = Open(host), ed = Open(device);
      ASSERT_TRUE(eh && ed);
      const GreedyRun a = Greedy(*eh, kPrompt, 12, first), b = Greedy(*ed, kPrompt, 12, first);
      ASSERT_EQ(a.ids.size(), 13u);
      EXPECT_EQ(a.ids, b.ids);
      ASSERT_EQ(a.logits.size(), b.logits.size());
      EXPECT_TRUE(testing::AllClose(b.logits, a.logits, 1e-5f, 1e-5f));
      const PolicyStats sh = eh->runtime().policy().stats(), sd = ed->runtime().policy().stats();
      EXPECT_EQ(sd.kv_exact_bytes, sh.kv_exact_bytes);
      EXPECT_EQ(sd.kv_kept_bytes, sh.kv_kept_bytes);
    }
  }
  EngineOptions device = Spindle(0.3, 0.9, 0.9);
  device.spindlekv_device_state = true;
  auto ed = Open(device);
  ASSERT_NE(ed, nullptr);
  Runtime& rt = ed->runtime();
  ASSERT_TRUE(rt.AddSequence(0, static_cast<int64_t>(kPrompt.size()), 4).ok());
  ASSERT_TRUE(rt.Prefill(0, kPrompt, nullptr).ok());
  auto captured = rt.policy().CapturePrefix(0, static_cast<int64_t>(kPrompt.size()));
  ASSERT_TRUE(captured.ok()) << captured.status();
  EXPECT_EQ((*captured)->tokens(), static_cast<int64_t>(kPrompt.size()));
  EXPECT_GT((*captured)->device_bytes(), 0u);
  // A benchmark's synthesized context goes through the same compression and
  // decodes.
  ASSERT_TRUE(rt.AddSequence(1, 300, 4).ok());
  ASSERT_TRUE(rt.policy().SynthesizeContext(1, 300, 7).ok());
  EXPECT_GT(rt.policy().DeviceBytes(1), 0u);
  auto l = rt.DecodeStep({0, 1}, {5, 6}, {static_cast<int64_t>(kPrompt.size()), 300});
  ASSERT_TRUE(l.ok()) << l.status();
  const int V = ed->config().vocab_size;
  for (int i = 0; i < 2 * V; ++i) ASSERT_TRUE(std::isfinite((*l)[i]));
}

// Documents under the device-state policy: a request's document is
// captured in device memory, and a second question attaches it (its cached
// prompt tokens: the document's) and answers as the host policy does with
// its own cached document. It exports to the host policy's blobs, byte for
// byte, and either policy imports the other's: a question attached to the
// import answers as one attached to the original.
TEST_F(SpindleKvTest, TheDeviceStatePolicyHoldsDocumentsAsTheHostPolicyDoes) {
  const std::vector<int32_t> doc = testing::LcgTokens(151, 7, true);
  auto request = [&](uint64_t seed, int n) {
    GenerationRequest r;
    r.prompt = doc;
    const std::vector<int32_t> q = testing::LcgTokens(n, seed, false);
    r.prompt.insert(r.prompt.end(), q.begin(), q.end());
    r.max_new_tokens = 12;
    r.document_ends = {static_cast<int64_t>(doc.size())};
    return r;
  };
  EngineOptions host = Spindle(0.3, 0.9, 0.9);
  host.runtime.prefix_cache_bytes = 16 << 20;
  EngineOptions device = host;
  device.spindlekv_device_state = true;
  auto eh = Open(host), ed = Open(device);
  ASSERT_TRUE(eh && ed);
  for (const GenerationRequest& r : {request(11, 20), request(12, 17), request(13, 9)}) {
    auto a = eh->runtime().Generate({r});
    auto b = ed->runtime().Generate({r});
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ((*b)[0].ids, (*a)[0].ids);
    EXPECT_EQ((*b)[0].cached_prompt_tokens, (*a)[0].cached_prompt_tokens);
  }
  // The second and third questions attached the cached document.
  auto again = ed->runtime().Generate({request(14, 5)});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)[0].cached_prompt_tokens, static_cast<int64_t>(doc.size()));

  // Export and import, across the two forms.
  auto capture = [&](Engine& e) -> std::shared_ptr<const KvPrefix> {
    Runtime& rt = e.runtime();
    SequenceSpec spec;
    spec.prompt_len = static_cast<int64_t>(doc.size());
    spec.max_new_tokens = 0;
    EXPECT_TRUE(rt.policy().AddSequence(50, spec).ok());
    EXPECT_TRUE(rt.Prefill(50, doc, nullptr).ok());
    auto p = rt.policy().TakePrefix(50, static_cast<int64_t>(doc.size()));
    EXPECT_TRUE(p.ok()) << p.status();
    rt.policy().RemoveSequence(50);
    return p.ok() ? *p : nullptr;
  };
  // A question's greedy ids on `e` attached to `p`.
  auto ask = [&](Engine& e, const std::shared_ptr<const KvPrefix>& p) {
    GenerationRequest r = request(15, 11);
    Runtime& rt = e.runtime();
    SequenceSpec spec;
    spec.prompt_len = static_cast<int64_t>(r.prompt.size());
    spec.max_new_tokens = 8;
    spec.prefix = p;
    EXPECT_TRUE(rt.policy().AddSequence(60, spec).ok());
    std::vector<float> logits;
    EXPECT_TRUE(rt.Prefill(60, r.prompt, &logits, static_cast<int64_t>(doc.size())).ok());
    const int V = e.config().vocab_size;
    std::vector<int32_t> ids;
    int32_t tok = static_cast<int32_t>(std::max_element(logits.end() - V, logits.end()) - (logits.end() - V));
    ids.push_back(tok);
    for (int i = 0; i < 8; ++i) {
      auto l = rt.DecodeStep({60}, {tok}, {static_cast<int64_t>(r.prompt.size()) + i});
      EXPECT_TRUE(l.ok()) << l.status();
      if (!l.ok()) break;
      tok = static_cast<int32_t>(std::max_element(*l, *l + V) - *l);
      ids.push_back(tok);
    }
    rt.policy().RemoveSequence(60);
    return ids;
  };
  auto ph = capture(*eh), pd = capture(*ed);
  ASSERT_TRUE(ph && pd);
  auto bh = ph->Export(), bd = pd->Export();
  ASSERT_TRUE(bh.ok()) << bh.status();
  ASSERT_TRUE(bd.ok()) << bd.status();
  EXPECT_TRUE(*bh == *bd) << "the device form's blobs are not the host form's";
  const std::vector<int32_t> want = ask(*eh, ph);
  EXPECT_EQ(ask(*ed, pd), want);
  auto into_device = ed->runtime().policy().ImportPrefix(*bh);
  ASSERT_TRUE(into_device.ok()) << into_device.status();
  EXPECT_EQ(ask(*ed, *into_device), want);
  auto into_host = eh->runtime().policy().ImportPrefix(*bd);
  ASSERT_TRUE(into_host.ok()) << into_host.status();
  EXPECT_EQ(ask(*eh, *into_host), want);
  // A damaged layer is refused by the device form as by the host's.
  std::map<std::string, std::string> bad = *bd;
  bad["layer.1"].resize(bad["layer.1"].size() / 2);
  auto refused = ed->runtime().policy().ImportPrefix(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kCorruption) << refused.status();
  EXPECT_NE(refused.status().message().find("layer.1"), std::string::npos) << refused.status();
}

// Options are checked and named; the docs table is the option table.
TEST_F(SpindleKvTest, BadOptionsAreRefusedNamingTheKey) {
  EngineOptions o = Spindle(0.3, 0.98, 0.95);
  o.spindlekv.pool = 4;
  auto e = Engine::Open(testing::StoriesDir(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("pool"), std::string::npos) << e.status();
  auto r = ConfigReader::FromString("kv_policy: spindlekv\nspindlekv:\n  reserve_ratio: 1.5\n", "e.yaml");
  ASSERT_TRUE(r.ok());
  EngineOptions y;
  Status s = LoadEngineOptions(*r, &y);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("reserve_ratio"), std::string::npos) << s;
  auto ok = ConfigReader::FromString("kv_policy: spindlekv\nspindlekv:\n  reserve_ratio: 0.2\n  window: 8\n", "e.yaml");
  ASSERT_TRUE(ok.ok());
  EngineOptions z;
  ASSERT_TRUE(LoadEngineOptions(*ok, &z).ok());
  EXPECT_EQ(z.kv_policy, "spindlekv");
  EXPECT_EQ(z.spindlekv.reserve_ratio, 0.2);
  EXPECT_EQ(z.spindlekv.window, 8);
}

TEST(SpindleKvOptionTableTest, TheDocsTableIsTheOptionTable) {
  EXPECT_TRUE(
      testing::GeneratedDocSectionIs("docs/kv-policies.md", "spindlekv options", SpindleKvOptionTable().Markdown()));
}

// Shards and other policies' prefixes are refused with typed errors; a
// request pinned to spindlekv is served.
TEST_F(SpindleKvTest, ShardsAndForeignPrefixesAreRefused) {
  auto e = Open(Spindle(0.3, 0.98, 0.95));
  EngineOptions fo;
  fo.backend.device = "cpu";
  fo.runtime.prefix_cache_bytes = 16 << 20;
  auto f = Open(fo);
  ASSERT_TRUE(e && f);
  KvPolicy& p = e->runtime().policy();
  SequenceSpec shard;
  shard.prompt_len = 100;
  shard.shard.position_base = 100;
  EXPECT_EQ(p.AddSequence(1, shard).code(), StatusCode::kUnimplemented);
  ASSERT_TRUE(f->runtime().AddSequence(0, 50, 0).ok());
  ASSERT_TRUE(f->runtime().Prefill(0, std::vector<int32_t>(kPrompt.begin(), kPrompt.begin() + 50), nullptr).ok());
  auto fp = f->runtime().policy().CapturePrefix(0, 50);
  ASSERT_TRUE(fp.ok()) << fp.status();
  SequenceSpec attach;
  attach.prompt_len = 80;
  attach.prefix = *fp;
  Status s = p.AddSequence(2, attach);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("full prefix"), std::string::npos) << s;
  GenerationRequest r;
  r.prompt = std::vector<int32_t>(kPrompt.begin(), kPrompt.begin() + 60);
  r.max_new_tokens = 4;
  r.kv_policy = "spindlekv";
  auto g = e->runtime().Generate({r});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)[0].ids.size(), 4u);
  r.kv_policy = "spindle";
  EXPECT_EQ(e->runtime().Generate({r}).status().code(), StatusCode::kInvalidArgument);
}

// A stored document is checked when imported: each damage below is refused
// with Corruption naming the blob and what is wrong, and the intact blobs
// import to a prefix that exports the same bytes.
TEST_F(SpindleKvTest, ADamagedStoredDocumentIsRefusedNamingWhatIsWrong) {
  auto e = Open(Spindle(0.3, 0.9, 0.9));
  ASSERT_NE(e, nullptr);
  Runtime& rt = e->runtime();
  ASSERT_TRUE(rt.AddSequence(0, 120, 0).ok());
  ASSERT_TRUE(rt.Prefill(0, std::vector<int32_t>(kPrompt.begin(), kPrompt.begin() + 120), nullptr).ok());
  auto p = rt.policy().TakePrefix(0, 120);
  ASSERT_TRUE(p.ok()) << p.status();
  rt.policy().RemoveSequence(0);
  auto blobs = (*p)->Export();
  ASSERT_TRUE(blobs.ok());
  auto again = rt.policy().ImportPrefix(*blobs);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(*(*again)->Export() == *blobs);
  // layer.0, KV head 0: [n][key entries] [n][value entries] [n][positions]
  // [n][key refs] [n][key magnitudes] ...; the last 4 bytes are the last KV
  // head's last token's query-head mask.
  const std::string& b = blobs->at("layer.0");
  auto count = [&](size_t at) {
    uint64_t n = 0;
    std::memcpy(&n, b.data() + at, sizeof(n));
    return n;
  };
  const size_t values = 8 + count(0) * 4;
  const size_t positions = values + 8 + count(values) * 4;
  const size_t krefs = positions + 8 + count(positions) * 4;
  const size_t kmags = krefs + 8 + count(krefs) * 4;
  ASSERT_GT(count(positions), 0u);
  auto damaged = [&](size_t at, const void* bytes, size_t n, const std::string& why) {
    auto bad = *blobs;
    if (at == b.size()) {
      bad["layer.0"].append(static_cast<const char*>(bytes), n);
    } else {
      std::memcpy(bad["layer.0"].data() + at, bytes, n);
    }
    auto r = rt.policy().ImportPrefix(bad);
    ASSERT_FALSE(r.ok()) << why;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status();
    EXPECT_NE(r.status().message().find("blob 'layer.0'"), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status();
  };
  const int32_t far = 1 << 30, negative = -1;
  const float nan = std::nanf("");
  damaged(krefs + 8, &far, 4, "reference outside its codebook");
  damaged(positions + 8, &negative, 4, "position outside the prefix");
  damaged(kmags + 8, &nan, 4, "magnitude");
  damaged(b.size() - 4, &far, 4, "query-head mask");
  const int32_t zero = 0;
  damaged(b.size() - 4, &zero, 4, "query-head mask");
  damaged(positions + 8, &far, 4, "position outside the prefix");
  ASSERT_GT(count(positions), 1u);
  damaged(positions + 12, &zero, 4, "out of order");  // the second position no later than the first
  damaged(b.size(), &far, 4, "bytes past its end");
  const uint64_t huge = uint64_t{1} << 40;
  damaged(0, &huge, 8, "an array of");
}

// Each query head keeps its own top tokens of its KV head (the paper's
// answer to GQA): two query heads of one KV head keep different sets, and
// the KV head holds their union once. Checked through the bytes the layers
// hold after a prefill: between one query head's kept tokens and two
// disjoint sets per KV head, and more than one set (they differ); the
// pyramid keeps more in the first layer than in the last.
TEST_F(SpindleKvTest, ThePyramidKeepsMoreInShallowLayers) {
  const std::vector<double> r = spindlekv::RetainRatios(0.3, 200, 16, 0.05, 5);
  ASSERT_EQ(r.size(), 5u);
  EXPECT_GT(r.front(), r.back());
  auto lossy = Open(Spindle(0.3, 1.5, 1.5));  // no sharing: bytes count tokens
  ASSERT_NE(lossy, nullptr);
  const GreedyRun l = Greedy(*lossy, kPrompt, 1);
  const ModelConfig& c = lossy->config();
  const size_t d = c.head_dim, T = kPrompt.size(), ctx = T - 16;
  // At most: each KV head holds the union of its 2 query heads' kept tokens
  // (<= 2 x kept + window); at least: one query head's (kept + window).
  size_t lo = 0, hi = 0;
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const size_t kept = static_cast<size_t>(spindlekv::KeptTokens(r[layer], ctx));
    const size_t tok = 2 * d * 4 + 24;
    lo += c.num_kv_heads * (kept + 16) * tok;
    hi += c.num_kv_heads * std::min(T, 2 * kept + 16) * tok;
  }
  EXPECT_GE(l.bytes_after_prefill, lo);
  EXPECT_LE(l.bytes_after_prefill, hi);
  EXPECT_GT(l.bytes_after_prefill, lo) << "the query heads of a KV head kept the same tokens";
}

}  // namespace
}  // namespace penumbra
