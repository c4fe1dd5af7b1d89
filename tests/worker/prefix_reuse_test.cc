// Prefix reuse on the CPU backend (f32, stories260K), for the full, the
// shadowkv, the spindlekv and the specontext policies: a request whose leading segments (a document) another
// request already prefilled attaches their KV state instead of prefilling
// them, and returns exactly the tokens of the same request run with no cache;
// requests sharing a document in one batch return what each returns alone;
// keys separate namespaces and preceding text; exported prefixes import into
// another engine; stored prefixes survive a restart and damaged ones are
// recomputed; bad input is refused; the memory tier (DocumentMemoryTier)
// evicts only what no sequence holds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/crypto.h"
#include "storage/segment_store.h"
#include "tests/storage/segment_store_test_util.h"
#include "tests/test_util.h"
#include "tests/worker/stories_shadowkv.h"
#include "tests/worker/tier0_release_case.h"
#include "worker/engine/document_cache.h"
#include "worker/engine/engine.h"
#include "worker/engine/shadowkv_prefix.h"

namespace penumbra {
namespace {

// Parameter: the KV policy ("full", "shadowkv", "shadowkv-staging": the
// staged value fetch, "shadowkv-dense": documents under min_prompt_tokens,
// "shadowkv-sparse": sparse continuations, "shadowkv-tier0": hot values in
// "device" memory, "shadowkv-paper" and "shadowkv-sparse-paper": the paper's
// one landmark per chunk; the others have two, as LossyShadowKvOptions;
// "shadowkv-model" and "shadowkv-sparse-model": landmarks stored in the
// model's dtype instead of the default fp8; a "-fp8" suffix: values stored as
// fp8 rows, in the value store, the document's buffers, tier 0 and on disk).
class PrefixReuseTest : public testing::StoriesTest, public ::testing::WithParamInterface<std::string> {};

std::unique_ptr<Engine> OpenEngine(size_t cache_bytes, const std::string& policy = "full",
                                   const std::string& store = "") {
  EngineOptions o = policy == "full" ? EngineOptions{} : testing::LossyShadowKvOptions();
  o.backend.device = "cpu";
  o.kv_policy = policy == "full" ? "full" : "shadowkv";
  if (policy == "spindlekv") {
    // Lossy: the pyramid keeps 30% of a document's context over the layers,
    // and keys and values above cos 0.9 share codebook entries.
    o.kv_policy = "spindlekv";
    o.spindlekv.reserve_ratio = 0.3;
    o.spindlekv.window = 16;
    o.spindlekv.key_threshold = 0.9;
    o.spindlekv.value_threshold = 0.9;
  }
  if (policy == "specontext") {
    // Lossy: 24 tokens per KV head chosen by a random head, each bringing
    // the next 2, a window of 8, the prompt's last 8 queries' weights as a
    // floor; every layer's keys and values in host memory.
    o.kv_policy = "specontext";
    o.specontext.head = "random";
    o.specontext.budget = 24;
    o.specontext.local = 8;
    o.specontext.successors = 2;
    o.specontext.observe = 8;
    o.specontext.device_layers = 0;
  }
  if (policy.rfind("shadowkv-staging", 0) == 0) o.shadowkv.value_fetch = "staging";
  if (policy == "shadowkv-dense") o.shadowkv.min_prompt_tokens = 1000;
  if (policy.rfind("shadowkv-sparse", 0) == 0) o.shadowkv.continuation = "sparse";
  // One landmark per chunk (the paper's): an attached document's landmark rows
  // read in place, captured, stored and imported at one row per chunk, where
  // the other policies keep two.
  if (policy.find("-paper") != std::string::npos) o.shadowkv.landmarks_per_chunk = 1;
  // Landmarks in the model's dtype (the default is fp8 records: e4m3 codes
  // and a scale per chunk) captured, stored, imported and read in place the
  // same way.
  if (policy.find("-model") != std::string::npos) o.shadowkv.landmark_format = "model";
  if (policy.find("-fp8") != std::string::npos) o.shadowkv.value_format = "fp8";
  if (policy.rfind("shadowkv-tier0", 0) == 0) {  // hot documents' values copied to "device" memory (here: host memory)
    o.runtime.tiers.on_host_backend = true;
    o.runtime.tiers.gpu_reserve_bytes = 0;
    o.runtime.tiers.promote_min_reads = 1;
  }
  if (policy == "shadowkv-sparse-all") {  // a sparse continuation that selects every chunk
    o.shadowkv.continuation = "sparse";
    o.shadowkv.continuation_budget_tokens = 1000;
    o.runtime.prefix_store_lazy_block_bytes = 4096;
  }
  o.runtime.prefix_cache_bytes = cache_bytes;
  o.prefix_store.path = store;
  o.prefix_store.sync_commit = false;
  // Every blob but the few a prefix is checked against read from the store
  // by the policy itself, as the large ones of a real document are.
  o.runtime.prefix_store_eager_blob_bytes = 4096;
  auto e = Engine::Open(testing::StoriesDir(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

using testing::LcgTokens;

// Adds sequence `seq` for `r` (first prefill: the 151-token document) and
// prefills the document: what a question then continues.
void AddFactoredDocument(Runtime& rt, int64_t seq, const GenerationRequest& r) {
  SequenceSpec spec;
  spec.prompt_len = static_cast<int64_t>(r.prompt.size());
  spec.max_new_tokens = 1;
  spec.first_prefill = 151;
  ASSERT_TRUE(rt.policy().AddSequence(seq, spec).ok());
  ASSERT_TRUE(rt.Prefill(seq, r.prompt, nullptr, 0, 151).ok());
}

GenerationRequest Request(const std::vector<int32_t>& doc, const std::vector<int32_t>& question, bool segmented,
                          const std::string& ns = "") {
  GenerationRequest r;
  r.prompt = doc;
  r.prompt.insert(r.prompt.end(), question.begin(), question.end());
  r.max_new_tokens = 24;
  if (segmented) r.document_ends = {static_cast<int64_t>(doc.size())};
  r.cache_namespace = ns;
  return r;
}

// Greedy ids of `r` on a fresh engine of `policy` with no prefix cache.
std::vector<int32_t> Cold(const GenerationRequest& r, const std::string& policy) {
  auto e = OpenEngine(0, policy);
  if (!e) return {};
  auto res = e->runtime().Generate({r});
  EXPECT_TRUE(res.ok()) << res.status();
  return res.ok() ? (*res)[0].ids : std::vector<int32_t>{};
}

const std::vector<int32_t> kDoc = LcgTokens(151, 7, true);
const std::vector<int32_t> kQ1 = LcgTokens(20, 11, false), kQ2 = LcgTokens(17, 12, false),
                           kQ3 = LcgTokens(9, 13, false);

TEST_P(PrefixReuseTest, CachedDocumentGivesTheColdTokens) {
  auto e = OpenEngine(64 << 20, GetParam());
  ASSERT_NE(e, nullptr);
  Runtime& rt = e->runtime();
  auto first = rt.Generate({Request(kDoc, kQ1, true)});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ((*first)[0].cached_prompt_tokens, 0);
  EXPECT_EQ((*first)[0].ids, Cold(Request(kDoc, kQ1, true), GetParam()));
  ASSERT_EQ(rt.prefix_cache()->entries(), 1u);

  auto second = rt.Generate({Request(kDoc, kQ2, true)});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)[0].cached_prompt_tokens, 151);
  EXPECT_EQ((*second)[0].ids, Cold(Request(kDoc, kQ2, true), GetParam()));
  EXPECT_EQ(rt.stats().cached_prompt_tokens, 151);
  EXPECT_EQ(rt.stats().prompt_tokens, 2 * 151 + 20 + 17);
  EXPECT_EQ(rt.prefix_cache()->stats().hits, 1);
  if (GetParam() == "full") {
    // Exact attention: segments change nothing.
    EXPECT_EQ((*second)[0].ids, Cold(Request(kDoc, kQ2, false), "full"));
  }
  if (GetParam().rfind("shadowkv-tier0", 0) == 0) {
    // The question's reads made the document hot: its values were copied
    // layer by layer while it decoded; a third question reads the copy.
    const TierStats t = rt.stats().tiers;
    EXPECT_EQ(t.promotions, 1);
    EXPECT_EQ(t.documents, 1);
    EXPECT_EQ(t.promoted_bytes, rt.prefix_cache()->Prefixes()[0]->promotable_bytes());
    const auto* doc = dynamic_cast<const ShadowKvPrefix*>(rt.prefix_cache()->Prefixes()[0].get());
    ASSERT_NE(doc, nullptr);
    EXPECT_TRUE(doc->values_on_device(0));
    EXPECT_NE(doc->values_device(0), static_cast<const void*>(doc->values_host(0)));
    // What is read is the copy: the host values scribbled over change nothing.
    const auto& g = doc->geometry();
    for (int l = 0; l < g.layers; ++l) {
      std::memset(const_cast<char*>(doc->values_host(l)), 0x7f,
                  static_cast<size_t>(g.hkv) * doc->value_stride() * g.ValueRowBytes());
    }
    auto third = rt.Generate({Request(kDoc, kQ3, true)});
    ASSERT_TRUE(third.ok()) << third.status();
    EXPECT_EQ((*third)[0].cached_prompt_tokens, 151);
    EXPECT_EQ((*third)[0].ids, Cold(Request(kDoc, kQ3, true), GetParam()));
    EXPECT_GT(doc->total_reads(), 0);
  }
}

TEST_P(PrefixReuseTest, RequestsSharingADocumentInOneBatchReturnWhatEachReturnsAlone) {
  auto e = OpenEngine(64 << 20, GetParam());
  ASSERT_NE(e, nullptr);
  auto res = e->runtime().Generate({Request(kDoc, kQ1, true), Request(kDoc, kQ2, true), Request(kDoc, kQ3, true)});
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ((*res)[0].cached_prompt_tokens, 0);
  EXPECT_EQ((*res)[1].cached_prompt_tokens, 151);
  EXPECT_EQ((*res)[2].cached_prompt_tokens, 151);
  EXPECT_EQ((*res)[0].ids, Cold(Request(kDoc, kQ1, true), GetParam()));
  EXPECT_EQ((*res)[1].ids, Cold(Request(kDoc, kQ2, true), GetParam()));
  EXPECT_EQ((*res)[2].ids, Cold(Request(kDoc, kQ3, true), GetParam()));
}

TEST_P(PrefixReuseTest, KeysSeparateNamespacesAndWhatComesBefore) {
  auto e = OpenEngine(64 << 20, GetParam());
  ASSERT_NE(e, nullptr);
  Runtime& rt = e->runtime();
  ASSERT_TRUE(rt.Generate({Request(kDoc, kQ1, true, "tenant-a")}).ok());
  // Another namespace: no hit.
  auto b = rt.Generate({Request(kDoc, kQ1, true, "tenant-b")});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)[0].cached_prompt_tokens, 0);
  // Two documents: the second's key covers the first. d1 + d2 cached; then
  // d1 + d3 reuses d1 only, and d3 + d2 (other text before d2) nothing.
  const std::vector<int32_t> d2 = LcgTokens(40, 21, false), d3 = LcgTokens(40, 22, false);
  auto two = [&](const std::vector<int32_t>& a, const std::vector<int32_t>& c) {
    GenerationRequest r = Request(a, c, false, "tenant-a");
    r.prompt.insert(r.prompt.end(), kQ2.begin(), kQ2.end());
    r.document_ends = {static_cast<int64_t>(a.size()), static_cast<int64_t>(a.size() + c.size())};
    return r;
  };
  auto d12 = rt.Generate({two(kDoc, d2)});
  ASSERT_TRUE(d12.ok());
  EXPECT_EQ((*d12)[0].cached_prompt_tokens, 151);  // kDoc from the first request
  EXPECT_EQ((*d12)[0].ids, Cold(two(kDoc, d2), GetParam()));
  auto d13 = rt.Generate({two(kDoc, d3)});
  ASSERT_TRUE(d13.ok());
  EXPECT_EQ((*d13)[0].cached_prompt_tokens, 151);
  auto again = rt.Generate({two(kDoc, d2)});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)[0].cached_prompt_tokens, 191);
  EXPECT_EQ((*again)[0].ids, (*d12)[0].ids);
  std::vector<int32_t> other_doc = kDoc;
  other_doc[5] += 1;  // one token differs before d2
  auto d32 = rt.Generate({two(other_doc, d2)});
  ASSERT_TRUE(d32.ok());
  EXPECT_EQ((*d32)[0].cached_prompt_tokens, 0);
}

TEST_P(PrefixReuseTest, ExportedPrefixImportsIntoAnotherEngine) {
  const std::string policy = GetParam();
  auto a = OpenEngine(0, policy), b = OpenEngine(0, policy), cold = OpenEngine(0, policy);
  ASSERT_TRUE(a && b && cold);
  const GenerationRequest r = Request(kDoc, kQ2, false);
  const int64_t P = static_cast<int64_t>(r.prompt.size());
  ASSERT_TRUE(a->runtime().AddSequence(0, 151, 1).ok());
  ASSERT_TRUE(a->runtime().Prefill(0, kDoc, nullptr).ok());
  auto captured = a->runtime().policy().CapturePrefix(0, 151);
  ASSERT_TRUE(captured.ok()) << captured.status();
  auto blobs = (*captured)->Export();
  ASSERT_TRUE(blobs.ok()) << blobs.status();
  a.reset();  // the import must not depend on the exporting engine

  KvPolicy& pb = b->runtime().policy();
  auto imported = pb.ImportPrefix(*blobs);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ((*imported)->tokens(), 151);
  SequenceSpec spec;
  spec.prompt_len = P;
  spec.max_new_tokens = 1;
  spec.prefix = *imported;
  ASSERT_TRUE(pb.AddSequence(0, spec).ok());
  std::vector<float> warm, ref;
  ASSERT_TRUE(b->runtime().Prefill(0, r.prompt, &warm, 151).ok());
  SequenceSpec cold_spec;
  cold_spec.prompt_len = P;
  cold_spec.max_new_tokens = 1;
  cold_spec.first_prefill = 151;
  ASSERT_TRUE(cold->runtime().policy().AddSequence(0, cold_spec).ok());
  ASSERT_TRUE(cold->runtime().Prefill(0, r.prompt, nullptr, 0, 151).ok());
  ASSERT_TRUE(cold->runtime().Prefill(0, r.prompt, &ref, 151).ok());
  if (policy == "full") {
    // Cascade attention: the question attends to its own keys and to the
    // prefix's in two parts merged by log-sum-exp, a different summation
    // order than one pass over all keys.
    EXPECT_TRUE(::penumbra::testing::AllClose(warm, ref, 1e-4f, 1e-4f));
  } else {
    EXPECT_EQ(warm, ref);
  }
  // A sparse shadowkv sequence reads the prefix's A rows, landmarks and
  // values in place: it holds less device memory than one that made them.
  if (policy == "full") {
    // A full sequence holds only its own rows; the prefix's K/V are read in place.
    const size_t cold_bytes = cold->runtime().policy().DeviceBytes(0);  // P + 1 rows
    EXPECT_EQ(pb.DeviceBytes(0), cold_bytes / (P + 1) * (P + 1 - 151));
  }
  if (policy == "shadowkv" || policy == "shadowkv-staging") {
    EXPECT_LT(pb.DeviceBytes(0) + (*imported)->device_bytes() / 2, cold->runtime().policy().DeviceBytes(0));
  }

  // Damaged or foreign blobs are refused, naming what is wrong.
  std::string victim;  // the largest blob
  for (const auto& [name, bytes] : *blobs) {
    if (name != "meta" && (victim.empty() || bytes.size() > blobs->at(victim).size())) victim = name;
  }
  auto bad = *blobs;
  bad[victim].pop_back();
  auto r1 = pb.ImportPrefix(bad);
  ASSERT_FALSE(r1.ok());
  EXPECT_EQ(r1.status().code(), StatusCode::kCorruption);
  EXPECT_NE(r1.status().message().find("blob '" + victim + "'"), std::string::npos) << r1.status();
  bad = *blobs;
  const size_t at = bad["meta"].find("layers=");
  ASSERT_NE(at, std::string::npos);
  bad["meta"].replace(at, 8, "layers=9");
  auto r2 = pb.ImportPrefix(bad);
  ASSERT_FALSE(r2.ok());
  EXPECT_EQ(r2.status().code(), StatusCode::kInvalidArgument) << r2.status();
  bad.erase(victim);
  EXPECT_FALSE(pb.ImportPrefix(bad).ok());
  // A sequence id in use, or a prefix that leaves nothing to prefill, is refused.
  EXPECT_EQ(pb.AddSequence(0, spec).code(), StatusCode::kInvalidArgument);
  spec.prompt_len = 151;
  EXPECT_EQ(pb.AddSequence(1, spec).code(), StatusCode::kInvalidArgument);
  pb.RemoveSequence(0);
}

// A document's put (a prefill-only request) ends its sequence there, so the
// policy may move the sequence's state into the prefix instead of copying it
// (shadowkv: the value store's rows become the prefix's, strided by the
// store's capacity). The moved prefix exports the same bytes as a copied one,
// and a question attached to it gets the cold tokens.
TEST_P(PrefixReuseTest, APutDocumentsStateMovesIntoTheCacheUnchanged) {
  const std::string policy = GetParam();
  auto e = OpenEngine(0, policy);
  ASSERT_NE(e, nullptr);
  Runtime& rt = e->runtime();
  KvPolicy& pol = rt.policy();
  for (int64_t seq : {0, 1}) {
    ASSERT_TRUE(rt.AddSequence(seq, 151, 0).ok());
    ASSERT_TRUE(rt.Prefill(seq, kDoc, nullptr).ok());
  }
  auto copied = pol.CapturePrefix(0, 151);
  ASSERT_TRUE(copied.ok()) << copied.status();
  auto moved = pol.TakePrefix(1, 151);
  ASSERT_TRUE(moved.ok()) << moved.status();
  if (policy == "shadowkv" || policy == "shadowkv-staging") {
    const auto* sp = dynamic_cast<const ShadowKvPrefix*>(moved->get());
    ASSERT_NE(sp, nullptr);
    EXPECT_GT(sp->value_stride(), sp->geometry().n_chunks);  // the store's rows, not a copy
    EXPECT_EQ(dynamic_cast<const ShadowKvPrefix*>(copied->get())->value_stride(), sp->geometry().n_chunks);
    EXPECT_EQ(pol.CapturePrefix(1, 151).status().code(), StatusCode::kFailedPrecondition);
  }
  pol.RemoveSequence(1);  // the prefix keeps what it took
  pol.RemoveSequence(0);
  auto a = (*copied)->Export(), b = (*moved)->Export();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(*a == *b);

  // A question attached to either gives the same logits.
  const GenerationRequest r = Request(kDoc, kQ1, false);
  const int64_t P = static_cast<int64_t>(r.prompt.size());
  std::vector<float> logits[2];
  for (int i = 0; i < 2; ++i) {
    SequenceSpec spec;
    spec.prompt_len = P;
    spec.max_new_tokens = 1;
    spec.prefix = i == 0 ? *copied : *moved;
    ASSERT_TRUE(pol.AddSequence(10 + i, spec).ok());
    ASSERT_TRUE(rt.Prefill(10 + i, r.prompt, &logits[i], 151).ok());
    pol.RemoveSequence(10 + i);
  }
  EXPECT_EQ(logits[0], logits[1]);

  // Through the runtime: a put (max_new_tokens 0) then a question about it.
  auto cached = OpenEngine(64 << 20, policy);
  ASSERT_NE(cached, nullptr);
  GenerationRequest put = Request(kDoc, {}, true);
  put.max_new_tokens = 0;
  auto p = cached->runtime().Generate({put});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)[0].finish_reason, "prefilled");
  for (const auto& q : {kQ1, kQ2}) {
    auto g = cached->runtime().Generate({Request(kDoc, q, true)});
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ((*g)[0].cached_prompt_tokens, 151);
    EXPECT_EQ((*g)[0].ids, Cold(Request(kDoc, q, true), policy));
  }
}

TEST_P(PrefixReuseTest, DocumentsSurviveARestartAndDamageIsRecomputedNotServed) {
  const std::string policy = GetParam();
  storage::testing::TempDir dir;
  const std::vector<int32_t> cold = Cold(Request(kDoc, kQ2, true), policy);
  {  // First process: prefills the document and stores it.
    auto e = OpenEngine(64 << 20, policy, dir.path());
    ASSERT_NE(e, nullptr);
    auto r = e->runtime().Generate({Request(kDoc, kQ1, true)});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].cached_prompt_tokens, 0);
    e->runtime().DrainPrefixStores();  // written in the background
    EXPECT_EQ(e->runtime().stats().prefix_store_errors, 0);
    EXPECT_EQ(e->runtime().stats().prefix_stores, 1);
  }
  {  // After a restart: the document comes from disk.
    auto e = OpenEngine(64 << 20, policy, dir.path());
    ASSERT_NE(e, nullptr);
    auto r = e->runtime().Generate({Request(kDoc, kQ2, true)});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].cached_prompt_tokens, 151);
    EXPECT_EQ((*r)[0].ids, cold);
    EXPECT_EQ(e->runtime().stats().prefix_store_hits, 1);
    if (policy.rfind("shadowkv", 0) == 0 && policy != "shadowkv-dense") {
      // ShadowKV values are read lazily: a sparse continuation reads the
      // blocks of the chunks it selects before the rest; every block is
      // read in the end.
      auto prefixes = e->runtime().prefix_cache()->Prefixes();
      ASSERT_EQ(prefixes.size(), 1u);
      const auto* p = dynamic_cast<const ShadowKvPrefix*>(prefixes[0].get());
      ASSERT_NE(p, nullptr);
      ASSERT_NE(p->lazy_values(), nullptr);
      ASSERT_TRUE(p->EnsureAllValues().ok());
      EXPECT_TRUE(p->values_complete());
      EXPECT_EQ(p->lazy_values()->blocks_read(), p->lazy_values()->blocks());
      // (This model's values are a few blocks, all of which the question
      // and its answer select; LazyBlobTest checks that only covering
      // blocks are read.)
      if (policy == "shadowkv-sparse") {
        EXPECT_GT(p->lazy_values()->blocks_on_demand(), 0);
      }
    }
  }
  {  // Another namespace does not see it, even on disk.
    auto e = OpenEngine(64 << 20, policy, dir.path());
    auto r = e->runtime().Generate({Request(kDoc, kQ2, true, "other")});
    ASSERT_TRUE(r.ok());
    EXPECT_EQ((*r)[0].cached_prompt_tokens, 0);
  }
  {  // Move everything from the log into files, then damage the blob files.
    storage::SegmentStoreOptions so;
    so.path = dir.path();
    auto st = storage::SegmentStore::Open(so);
    ASSERT_TRUE(st.ok()) << st.status();
    ASSERT_TRUE((*st)->Flush().ok());
  }
  ASSERT_GT(storage::testing::FlipBytesInFiles(dir.path(), ".blob", 16), 0);
  {  // The damaged document is detected, dropped and recomputed: the cold tokens.
    auto e = OpenEngine(64 << 20, policy, dir.path());
    ASSERT_NE(e, nullptr);
    auto r = e->runtime().Generate({Request(kDoc, kQ2, true)});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].cached_prompt_tokens, 0);
    EXPECT_EQ((*r)[0].ids, cold);
    EXPECT_EQ(e->runtime().stats().prefix_store_corruptions, 1);
  }
  {  // ... and stored anew by that request.
    auto e = OpenEngine(64 << 20, policy, dir.path());
    auto r = e->runtime().Generate({Request(kDoc, kQ3, true)});
    ASSERT_TRUE(r.ok());
    EXPECT_EQ((*r)[0].cached_prompt_tokens, 151);
    EXPECT_EQ((*r)[0].ids, Cold(Request(kDoc, kQ3, true), policy));
  }
}

// A document stored by an engine of one landmark or value format is not
// attached by one of the other, either way round: the formats are part of the
// state's fingerprint, so each computes its own (the cold tokens) and then
// finds its own on disk.
TEST_F(PrefixReuseTest, ADocumentStoredInAnotherFormatIsRecomputed) {
  for (const auto& pair :
       std::vector<std::pair<std::string, std::string>>{{"shadowkv-model", "shadowkv"}, {"shadowkv", "shadowkv-fp8"}}) {
    storage::testing::TempDir dir;
    for (const std::string& policy : {pair.first, pair.second}) {
      SCOPED_TRACE(policy);
      const std::vector<int32_t> cold = Cold(Request(kDoc, kQ2, true), policy);
      {
        auto e = OpenEngine(64 << 20, policy, dir.path());
        ASSERT_NE(e, nullptr);
        auto r = e->runtime().Generate({Request(kDoc, kQ2, true)});
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_EQ((*r)[0].cached_prompt_tokens, 0);  // the other format's document is not this one's
        EXPECT_EQ((*r)[0].ids, cold);
        e->runtime().DrainPrefixStores();
        EXPECT_EQ(e->runtime().stats().prefix_stores, 1);
      }
      auto e = OpenEngine(64 << 20, policy, dir.path());
      ASSERT_NE(e, nullptr);
      auto r = e->runtime().Generate({Request(kDoc, kQ2, true)});
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ((*r)[0].cached_prompt_tokens, 151);
      EXPECT_EQ((*r)[0].ids, cold);
      EXPECT_EQ(e->runtime().stats().prefix_store_hits, 1);
    }
  }
}

// The blobs of a document with fp8 values, given to a policy that stores
// bf16 values (an export carried by hand, a store written under another
// name): refused with a typed error naming both formats, never read as rows
// of the other size.
TEST_F(PrefixReuseTest, AnExportWithTheOtherValueFormatIsRefused) {
  auto fp8 = OpenEngine(64 << 20, "shadowkv-fp8");
  ASSERT_NE(fp8, nullptr);
  auto r = fp8->runtime().Generate({Request(kDoc, kQ1, true)});
  ASSERT_TRUE(r.ok()) << r.status();
  auto prefixes = fp8->runtime().prefix_cache()->Prefixes();
  ASSERT_EQ(prefixes.size(), 1u);
  auto blobs = prefixes[0]->Export();
  ASSERT_TRUE(blobs.ok()) << blobs.status();
  EXPECT_NE(blobs->at("meta").find("value_format=fp8"), std::string::npos) << blobs->at("meta");
  auto bf16 = OpenEngine(64 << 20, "shadowkv");
  ASSERT_NE(bf16, nullptr);
  auto imported = bf16->runtime().policy().ImportPrefix(*blobs);
  EXPECT_EQ(imported.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(imported.status().message().find("value_format=fp8"), std::string::npos) << imported.status();
  // ... and the same policy takes it back.
  auto again = fp8->runtime().policy().ImportPrefix(*blobs);
  EXPECT_TRUE(again.ok()) << again.status();
}

// A value block read lazily (after a restart) that fails its check while a
// question's prefill needs it: the document is dropped from memory and disk,
// and the request starts over without it, returning a fresh prefill's tokens.
TEST_F(PrefixReuseTest, ALazilyReadValueThatFailsItsCheckIsRecomputedNotServed) {
  const std::string policy = "shadowkv-sparse-all";
  storage::testing::TempDir dir;
  {
    auto e = OpenEngine(64 << 20, policy, dir.path());
    ASSERT_NE(e, nullptr);
    ASSERT_TRUE(e->runtime().Generate({Request(kDoc, kQ1, true)}).ok());
    e->runtime().DrainPrefixStores();
    ASSERT_EQ(e->runtime().stats().prefix_stores, 1);
  }
  {
    storage::SegmentStoreOptions so;
    so.path = dir.path();
    auto st = storage::SegmentStore::Open(so);
    ASSERT_TRUE(st.ok()) << st.status();
    ASSERT_TRUE((*st)->Flush().ok());
  }
  // The values are the segment's last blob ("values" sorts last), so the
  // newest blob file ends with their last block: one byte of its payload
  // flipped (before the 32-byte file footer).
  std::filesystem::path newest;
  for (const auto& f : std::filesystem::directory_iterator(dir.path())) {
    const bool newer = newest.empty() || f.path().filename() > newest.filename();
    if (f.path().extension() == ".blob" && newer) newest = f.path();
  }
  ASSERT_FALSE(newest.empty());
  storage::testing::FlipByteAt(newest, static_cast<std::streamoff>(std::filesystem::file_size(newest)) - 32 - 100);
  auto e = OpenEngine(64 << 20, policy, dir.path());
  ASSERT_NE(e, nullptr);
  auto r = e->runtime().Generate({Request(kDoc, kQ2, true)});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].ids, Cold(Request(kDoc, kQ2, true), policy));
  EXPECT_EQ((*r)[0].cached_prompt_tokens, 0);  // started over without it
  EXPECT_EQ(e->runtime().stats().prefix_store_corruptions, 1);
  EXPECT_EQ(e->runtime().stats().prefix_store_hits, 1);  // it was imported (lazily) first
}

INSTANTIATE_TEST_SUITE_P(Policies, PrefixReuseTest,
                         ::testing::Values("full", "shadowkv", "shadowkv-staging", "shadowkv-dense", "shadowkv-sparse",
                                           "shadowkv-tier0", "shadowkv-paper", "shadowkv-sparse-paper",
                                           "shadowkv-model", "shadowkv-sparse-model", "shadowkv-fp8",
                                           "shadowkv-staging-fp8", "shadowkv-sparse-fp8", "shadowkv-tier0-fp8",
                                           "spindlekv", "specontext"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

// The continuation's own accuracy, against an independent reference: at
// full rank (hkv*d = 32) a chunk's K rebuilt from A·B is its exact K, so a
// question prefilled after a factored document (every chunk rebuilt, the
// outliers' exact keys put back at their places, every value restored from
// the store and the attached prefix) must see what full attention sees.
class ShadowKvContinuationTest : public PrefixReuseTest {};

TEST_P(ShadowKvContinuationTest, AtFullRankItMatchesFullAttention) {
  const GenerationRequest r = Request(kDoc, kQ1, true);
  const int64_t P = static_cast<int64_t>(r.prompt.size());
  auto full = OpenEngine(0, "full");
  ASSERT_NE(full, nullptr);
  std::vector<float> want;
  ASSERT_TRUE(full->runtime().AddSequence(0, P, 1).ok());
  ASSERT_TRUE(full->runtime().Prefill(0, r.prompt, &want).ok());
  EngineOptions o = testing::LossyShadowKvOptions();
  o.shadowkv.rank = 32;
  if (GetParam() == "shadowkv-staging") o.shadowkv.value_fetch = "staging";
  if (GetParam() == "shadowkv-sparse") {
    // Every chunk selected: the same keys in decode's row order (outliers,
    // selected chunks, local rows), which attention does not depend on.
    o.shadowkv.continuation = "sparse";
    o.shadowkv.continuation_budget_tokens = 1000;
  }
  o.runtime.prefix_cache_bytes = 64 << 20;
  auto e = Engine::Open(testing::StoriesDir(), o);
  ASSERT_TRUE(e.ok()) << e.status();
  Runtime& rt = (*e)->runtime();
  SequenceSpec spec;
  spec.prompt_len = P;
  spec.max_new_tokens = 1;
  spec.first_prefill = 151;
  ASSERT_TRUE(rt.policy().AddSequence(0, spec).ok());
  ASSERT_TRUE(rt.Prefill(0, r.prompt, nullptr, 0, 151).ok());
  auto prefix = rt.policy().CapturePrefix(0, 151);
  ASSERT_TRUE(prefix.ok()) << prefix.status();
  std::vector<float> got;
  ASSERT_TRUE(rt.Prefill(0, r.prompt, &got, 151).ok());
  EXPECT_TRUE(testing::AllClose(got, want, 1e-4f, 1e-4f));
  // The same from the captured prefix (values read from the prefix in place).
  spec.prefix = *prefix;
  ASSERT_TRUE(rt.policy().AddSequence(1, spec).ok());
  std::vector<float> attached;
  ASSERT_TRUE(rt.Prefill(1, r.prompt, &attached, 151).ok());
  EXPECT_EQ(attached, got);
  // A capture must be of all the sequence holds.
  EXPECT_EQ(rt.policy().CapturePrefix(1, 151).status().code(), StatusCode::kFailedPrecondition);
}

INSTANTIATE_TEST_SUITE_P(ValueFetch, ShadowKvContinuationTest,
                         ::testing::Values("shadowkv", "shadowkv-staging", "shadowkv-sparse"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return i.param == "shadowkv" ? std::string("zero_copy") : i.param.substr(9);
                         });

// A sparse continuation under its budget attends to the chunks the
// question's queries select, not to all of them: its logits are finite and
// differ from the dense continuation's.
TEST_F(PrefixReuseTest, ASparseContinuationAttendsToTheChunksTheQuestionSelects) {
  const GenerationRequest r = Request(kDoc, kQ1, true);
  std::vector<std::vector<float>> logits;
  for (const char* mode : {"dense", "sparse"}) {
    EngineOptions o = testing::LossyShadowKvOptions();
    o.shadowkv.continuation = mode;
    auto e = Engine::Open(testing::StoriesDir(), o);
    ASSERT_TRUE(e.ok()) << e.status();
    Runtime& rt = (*e)->runtime();
    AddFactoredDocument(rt, 0, r);
    std::vector<float> got;
    ASSERT_TRUE(rt.Prefill(0, r.prompt, &got, 151).ok());
    for (float v : got) ASSERT_TRUE(std::isfinite(v));
    logits.push_back(got);
  }
  EXPECT_FALSE(testing::AllClose(logits[0], logits[1], 1e-3f, 1e-3f));
}

// continuation: auto (the default) is sparse for a continuation of at most
// continuation_auto_max_tokens tokens and dense for a longer one: the same
// logits, bit for bit, as the mode it picks.
TEST_F(PrefixReuseTest, AnAutoContinuationIsSparseForAQuestionAndDenseBeyondItsLimit) {
  const GenerationRequest r = Request(kDoc, kQ1, true);
  const int64_t question = static_cast<int64_t>(r.prompt.size()) - 151;
  auto logits = [&](const std::string& mode, int64_t auto_max) {
    EngineOptions o = testing::LossyShadowKvOptions();
    o.shadowkv.continuation = mode;
    o.shadowkv.continuation_auto_max_tokens = auto_max;
    auto e = Engine::Open(testing::StoriesDir(), o);
    EXPECT_TRUE(e.ok()) << e.status();
    std::vector<float> got;
    if (!e.ok()) return got;
    Runtime& rt = (*e)->runtime();
    AddFactoredDocument(rt, 0, r);
    EXPECT_TRUE(rt.Prefill(0, r.prompt, &got, 151).ok());
    // The policy counts the continuation as the mode it took, once.
    const PolicyStats st = rt.policy().stats();
    const bool sparse = mode == "sparse" || (mode == "auto" && question <= auto_max);
    EXPECT_EQ(st.sparse_continuations, sparse ? 1 : 0) << mode << " " << auto_max;
    EXPECT_EQ(st.dense_continuations, sparse ? 0 : 1) << mode << " " << auto_max;
    return got;
  };
  EXPECT_EQ(ShadowKvOptions{}.continuation, "auto");
  const std::vector<float> dense = logits("dense", 0), sparse = logits("sparse", 0);
  ASSERT_FALSE(testing::AllClose(dense, sparse, 1e-3f, 1e-3f));  // the two modes differ here
  EXPECT_EQ(logits("auto", question), sparse);
  EXPECT_EQ(logits("auto", 1024), sparse);
  EXPECT_EQ(logits("auto", question - 1), dense);
}

// Questions about one cached document decoded in one batch form a group
// attached to one prefix: every sequence-layer scored is counted as scored
// with the document's other questions (ShadowkvScoreArgs::one_prefix, which
// this CPU backend also checks), and their tokens are each question's own.
// Questions about two documents of the same length share a group but not a
// prefix: none is.
TEST_F(PrefixReuseTest, QuestionsAboutOneDocumentAreScoredTogether) {
  auto e = OpenEngine(64 << 20, "shadowkv");
  ASSERT_NE(e, nullptr);
  Runtime& rt = e->runtime();
  const std::vector<int32_t> other = LcgTokens(151, 8, true);
  for (const auto& doc : {kDoc, other}) ASSERT_TRUE(rt.Generate({Request(doc, kQ1, true)}).ok());  // cached
  std::vector<GenerationRequest> qs;
  for (uint64_t q = 0; q < 3; ++q) qs.push_back(Request(kDoc, LcgTokens(20, 30 + q, false), true));
  const PolicyStats before = rt.policy().stats();
  auto together = rt.Generate(qs);
  ASSERT_TRUE(together.ok()) << together.status();
  const PolicyStats mid = rt.policy().stats();
  ASSERT_GT(mid.scored_sequences, before.scored_sequences);
  EXPECT_EQ(mid.one_prefix_sequences - before.one_prefix_sequences, mid.scored_sequences - before.scored_sequences);
  for (size_t i = 0; i < qs.size(); ++i) {
    EXPECT_EQ((*together)[i].cached_prompt_tokens, 151) << i;
    EXPECT_EQ((*together)[i].ids, Cold(qs[i], "shadowkv")) << "question " << i;
  }
  auto mixed = rt.Generate({Request(kDoc, kQ2, true), Request(other, kQ2, true)});
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  const PolicyStats after = rt.policy().stats();
  EXPECT_GT(after.scored_sequences, mid.scored_sequences);
  EXPECT_EQ(after.one_prefix_sequences, mid.one_prefix_sequences);
}

TEST_F(PrefixReuseTest, BadSegmentEndsAreRefused) {
  auto e = OpenEngine(64 << 20);
  ASSERT_NE(e, nullptr);
  for (const std::vector<int64_t>& ends : {std::vector<int64_t>{0}, {50, 50}, {171}, {200}, {60, 40}}) {
    GenerationRequest r = Request(kDoc, kQ1, false);
    r.document_ends = ends;
    auto res = e->runtime().Generate({r});
    ASSERT_FALSE(res.ok());
    EXPECT_EQ(res.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(res.status().message().find("document end"), std::string::npos) << res.status();
  }
  EXPECT_TRUE(e->runtime().Generate({Request(kDoc, kQ1, true)}).ok());  // still serving
}

// A request may name a document by its digest instead of sending its ids
// (ids_from): a worker that holds it answers as if the ids had come; one
// that does not says so (FailedPrecondition), and ids that do not match
// their digest are refused.
TEST_P(PrefixReuseTest, ADocumentNamedByItsDigestAnswersAsItsIdsWould) {
  auto e = OpenEngine(64 << 20, GetParam());
  ASSERT_NE(e, nullptr);
  Runtime& rt = e->runtime();
  const Hash128 digest = DocumentDigest(kDoc.data(), kDoc.size());
  auto by_reference = [&](const std::vector<int32_t>& question) {
    GenerationRequest r = Request(kDoc, question, true);
    std::fill(r.prompt.begin(), r.prompt.begin() + static_cast<int64_t>(kDoc.size()), 0);  // not sent
    r.document_digests = {digest};
    r.ids_from = static_cast<int64_t>(kDoc.size());
    return r;
  };
  // Not held yet: refused before any work, typed.
  auto missing = rt.Generate({by_reference(kQ1)});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kFailedPrecondition) << missing.status();
  EXPECT_NE(missing.status().message().find("document 0"), std::string::npos) << missing.status();
  // Ids that are not the named document.
  GenerationRequest wrong = Request(kDoc, kQ1, true);
  wrong.document_digests = {DocumentDigest(kQ1.data(), kQ1.size())};
  auto refused = rt.Generate({wrong});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status();
  // Put with its ids (and its digest), then asked by reference.
  GenerationRequest put = Request(kDoc, {}, true);
  put.max_new_tokens = 0;
  put.document_digests = {digest};
  ASSERT_TRUE(rt.Generate({put}).ok());
  auto answer = rt.Generate({by_reference(kQ2)});
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ((*answer)[0].cached_prompt_tokens, 151);
  EXPECT_EQ((*answer)[0].ids, Cold(Request(kDoc, kQ2, true), GetParam()));
  // The digests computed from the ids name the same cache entry.
  auto with_ids = rt.Generate({Request(kDoc, kQ3, true)});
  ASSERT_TRUE(with_ids.ok()) << with_ids.status();
  EXPECT_EQ((*with_ids)[0].cached_prompt_tokens, 151);
}

TEST_F(PrefixReuseTest, AStoreWithoutADeviceCacheIsRefused) {
  storage::testing::TempDir dir;
  EngineOptions o;
  o.backend.device = "cpu";
  o.prefix_store.path = dir.path();
  auto e = Engine::Open(testing::StoriesDir(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("memory.device_bytes"), std::string::npos) << e.status();
}

class FakePrefix final : public KvPrefix {
 public:
  FakePrefix(int64_t tokens, size_t bytes, size_t host = 0) : tokens_(tokens), bytes_(bytes), host_(host) {}
  std::string policy() const override { return "fake"; }
  int64_t tokens() const override { return tokens_; }
  size_t device_bytes() const override { return bytes_; }
  size_t host_bytes() const override { return host_; }
  Result<std::map<std::string, std::string>> Export() const override { return std::map<std::string, std::string>{}; }

 private:
  int64_t tokens_;
  size_t bytes_, host_;
};

// A prefix's meta names its landmarks per chunk when there are several; a
// meta without the field (documents stored before it) reads as one, and a
// count that does not divide the chunk is refused naming the field.
// A question about a document whose values are in tier 0 reads them in
// place (the fetch copies only its own chunks). When the copy is freed while
// it decodes (an admission's Release), its next steps copy them again: the
// slots its in-place steps filled hold no value rows, so they are refetched,
// and the tokens stay the cold ones.
TEST(ShadowKvTier0Test, FreeingTheCopyMidDecodeKeepsTheColdTokens) {
  auto e = OpenEngine(64 << 20, "shadowkv-tier0");
  ASSERT_NE(e, nullptr);
  Runtime& rt = e->runtime();
  ASSERT_TRUE(rt.Generate({Request(kDoc, kQ1, true)}).ok());
  ASSERT_TRUE(rt.Generate({Request(kDoc, kQ2, true)}).ok());  // its reads promote the document
  ASSERT_EQ(rt.prefix_cache()->Prefixes().size(), 1u);
  const auto* doc = dynamic_cast<const ShadowKvPrefix*>(rt.prefix_cache()->Prefixes()[0].get());
  ASSERT_NE(doc, nullptr);
  ASSERT_TRUE(doc->values_on_device(0));

  const GenerationRequest r = Request(kDoc, kQ3, true);
  GenerationResult res;
  const std::vector<int32_t> ids = testing::GreedyReleasingTier0(rt, *doc, r, /*seq=*/100, /*release_at=*/8, &res);
  EXPECT_EQ(res.cached_prompt_tokens, 151);
  EXPECT_EQ(ids, Cold(r, "shadowkv-tier0"));
}

TEST(ShadowKvPrefixGeometryTest, MetaCarriesLandmarksPerChunk) {
  ShadowKvPrefixGeometry g;
  g.tokens = 100;
  g.factored = 100;
  g.sparse = true;
  g.n_chunks = 20;
  g.outliers = 2;
  g.tail = 20;
  g.layers = 2;
  g.hkv = 4;
  g.head_dim = 8;
  g.rank = 12;
  g.chunk_size = 4;
  const std::string one = g.Meta();
  EXPECT_EQ(one.find("landmarks_per_chunk"), std::string::npos);
  auto back = ShadowKvPrefixGeometry::ParseMeta(one);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->landmarks_per_chunk, 1);
  g.landmarks_per_chunk = 2;
  EXPECT_EQ(g.BlobBytes().at("lm"), 2 * 4 * 20 * 2 * 8 * sizeof(float));
  back = ShadowKvPrefixGeometry::ParseMeta(g.Meta());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->landmarks_per_chunk, 2);
  EXPECT_EQ(back->Meta(), g.Meta());
  for (const char* bad : {" landmarks_per_chunk=3", " landmarks_per_chunk=0", " landmarks_per_chunk=x"}) {
    const auto st = ShadowKvPrefixGeometry::ParseMeta(one + bad).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("landmarks_per_chunk"), std::string::npos) << st;
  }
  // fp8 landmarks: a record of 2 x 8 codes and a 16-byte tail per chunk.
  EXPECT_EQ(g.Meta().find("landmark_format"), std::string::npos);
  g.landmark_fp8 = true;
  EXPECT_EQ(g.BlobBytes().at("lm"), 2 * 4 * 20 * (2 * 8 + 16));
  back = ShadowKvPrefixGeometry::ParseMeta(g.Meta());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->landmark_fp8);
  EXPECT_EQ(back->Meta(), g.Meta());
  const auto st = ShadowKvPrefixGeometry::ParseMeta(one + " landmark_format=int4").status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("landmark_format"), std::string::npos) << st;
  // fp8 values: a row of 4 x 8 codes and 4 f32 scales, 16-byte aligned.
  EXPECT_EQ(g.BlobBytes().at("values"), 2 * 4 * 20 * 4 * 8 * sizeof(float));
  EXPECT_EQ(g.Meta().find("value_format"), std::string::npos);
  g.value_fp8 = true;
  EXPECT_EQ(g.ValueRowBytes(), 48u);
  EXPECT_EQ(g.BlobBytes().at("values"), 2 * 4 * 20 * 48);
  back = ShadowKvPrefixGeometry::ParseMeta(g.Meta());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->value_fp8);
  EXPECT_EQ(back->Meta(), g.Meta());
  const auto vst = ShadowKvPrefixGeometry::ParseMeta(one + " value_format=int4").status();
  EXPECT_EQ(vst.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(vst.message().find("value_format"), std::string::npos) << vst;
  // A meta whose blobs would not fit any machine (or would wrap size_t) is
  // refused before anything is allocated.
  const auto huge = ShadowKvPrefixGeometry::ParseMeta(
                        "shadowkv-prefix v2 tokens=8000000000 factored=8000000000 sparse=1 chunks=2000000000 "
                        "outliers=0 tail=0 layers=4096 kv_heads=4096 head_dim=4096 rank=1000000 chunk_size=4 dtype=f32")
                        .status();
  EXPECT_EQ(huge.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(huge.message().find("1 TiB"), std::string::npos) << huge;
}

TEST(DocumentMemoryTierTest, EvictsLeastRecentlyUsedUnheldEntries) {
  DocumentMemoryTier c(300);
  auto keys = PrefixKeys("fence", {1, 2, 3, 4, 5}, {1, 2, 3, 4});
  ASSERT_EQ(keys.size(), 4u);
  EXPECT_NE(keys[0], keys[1]);
  EXPECT_EQ(PrefixKeys("fence", {1, 2, 3, 4, 5}, {1, 2})[1], keys[1]);
  EXPECT_NE(PrefixKeys("other", {1, 2, 3, 4, 5}, {1, 2})[1], keys[1]);
  EXPECT_NE(PrefixKeys("fence", {1, 9, 3, 4, 5}, {1, 2})[1], keys[1]);
  // Document boundaries are part of the key: {1},{2} is not {1,2}.
  EXPECT_NE(PrefixKeys("fence", {1, 2, 3}, {2})[0], keys[1]);

  EXPECT_TRUE(c.Insert(keys[0], std::make_shared<FakePrefix>(1, 100)));
  auto held = std::make_shared<FakePrefix>(2, 100);
  EXPECT_TRUE(c.Insert(keys[1], held));  // held outside the cache, like an attached sequence
  EXPECT_TRUE(c.Insert(keys[2], std::make_shared<FakePrefix>(3, 100)));
  EXPECT_NE(c.Find(keys[0], 1), nullptr);  // 0 becomes the most recent
  EXPECT_EQ(c.Find(keys[0], 2), nullptr);  // a token count that does not match is a miss
  EXPECT_TRUE(c.Insert(keys[3], std::make_shared<FakePrefix>(4, 100)));
  // Oldest first, skipping the held entry: 2 went, 0 and 1 stayed.
  EXPECT_FALSE(c.Contains(keys[2]));
  EXPECT_TRUE(c.Contains(keys[0]) && c.Contains(keys[1]) && c.Contains(keys[3]));
  EXPECT_EQ(c.bytes(), 300u);
  EXPECT_FALSE(c.Insert(PrefixKeys("x", {1}, {1})[0], std::make_shared<FakePrefix>(1, 400)));  // never fits
  EXPECT_EQ(c.stats().evictions, 1);
}

TEST(DocumentMemoryTierTest, HostBytesAreBoundedToo) {
  DocumentMemoryTier c(1000, 250);
  auto keys = PrefixKeys("fence", {1, 2, 3, 4}, {1, 2, 3});
  EXPECT_TRUE(c.Insert(keys[0], std::make_shared<FakePrefix>(1, 10, 100)));
  EXPECT_TRUE(c.Insert(keys[1], std::make_shared<FakePrefix>(2, 10, 100)));
  EXPECT_EQ(c.host_bytes(), 200u);
  EXPECT_TRUE(c.Insert(keys[2], std::make_shared<FakePrefix>(3, 10, 100)));  // evicts the oldest by host bytes
  EXPECT_FALSE(c.Contains(keys[0]));
  EXPECT_EQ(c.host_bytes(), 200u);
  EXPECT_EQ(c.bytes(), 20u);
  EXPECT_FALSE(c.Insert(PrefixKeys("x", {1}, {1})[0], std::make_shared<FakePrefix>(1, 1, 300)));  // never fits
}

TEST(DocumentMemoryTierTest, AnInsertThatMustEvictEvictsDownToTheLowWatermark) {
  DocumentMemoryTier c(1000, SIZE_MAX, 0.5);
  auto keys = PrefixKeys("fence", {1, 2, 3, 4, 5, 6, 7}, {1, 2, 3, 4, 5, 6});
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(c.Insert(keys[i], std::make_shared<FakePrefix>(i + 1, 200)));
  EXPECT_EQ(c.bytes(), 800u);  // fits: nothing evicted
  EXPECT_EQ(c.stats().evictions, 0);
  // 800 + 300 > 1000: evicted oldest first until 300 more fit under 500.
  EXPECT_TRUE(c.Insert(keys[4], std::make_shared<FakePrefix>(5, 300)));
  EXPECT_EQ(c.bytes(), 500u);
  EXPECT_EQ(c.stats().evictions, 3);
  EXPECT_TRUE(c.Contains(keys[3]) && c.Contains(keys[4]));
  // An entry larger than the low watermark leaves only room for itself.
  EXPECT_TRUE(c.Insert(keys[5], std::make_shared<FakePrefix>(6, 700)));
  EXPECT_EQ(c.bytes(), 700u);
  EXPECT_TRUE(c.Contains(keys[5]));
  // At 1 (the default) only what is needed.
  DocumentMemoryTier d(1000);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(d.Insert(keys[i], std::make_shared<FakePrefix>(i + 1, 250)));
  EXPECT_TRUE(d.Insert(keys[4], std::make_shared<FakePrefix>(5, 250)));
  EXPECT_EQ(d.stats().evictions, 1);
  EXPECT_EQ(d.bytes(), 1000u);
}

TEST(DocumentWriterTest, WritesInTheBackgroundBoundsItsQueueAndCountsFailures) {
  storage::testing::TempDir dir;
  storage::SegmentStoreOptions so;
  so.path = dir.path();
  so.sync_commit = false;
  so.capacity_bytes = 5000;
  auto store = storage::SegmentStore::Open(so);
  ASSERT_TRUE(store.ok()) << store.status();
  auto keys = PrefixKeys("w", {1, 2, 3, 4}, {1, 2, 3});
  {
    DocumentWriter w(store->get(), 8000);
    EXPECT_TRUE(w.Enqueue(keys[0], "ns", 1, {{"a", std::string(1000, 'x')}}));
    EXPECT_FALSE(w.Enqueue(keys[1], "ns", 2, {{"a", std::string(9000, 'y')}}));  // over the queue bound
    w.Drain();
    EXPECT_TRUE(w.Enqueue(keys[1], "ns", 2, {{"a", std::string(7500, 'y')}}));  // fits the queue, not the store
    EXPECT_TRUE(w.Enqueue(keys[2], "ns", 3, {{"a", std::string(500, 'z')}}));
    w.Drain();
    EXPECT_EQ(w.stored(), 2);
    EXPECT_EQ(w.skipped(), 1);
    EXPECT_EQ(w.errors(), 1);  // ResourceExhausted from the store: counted, not fatal
    EXPECT_TRUE(w.Enqueue(PrefixKeys("w", {9}, {1})[0], "ns", 1, {{"a", std::string(100, 'q')}}));
  }  // the destructor finishes the queued write
  EXPECT_TRUE((*store)->Contains(keys[0]));
  EXPECT_FALSE((*store)->Contains(keys[1]));
  EXPECT_TRUE((*store)->Contains(PrefixKeys("w", {9}, {1})[0]));
  auto got = (*store)->Get(keys[2]);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->at("a"), std::string(500, 'z'));
}

}  // namespace
}  // namespace penumbra
