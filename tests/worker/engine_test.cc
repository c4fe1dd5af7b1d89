// End-to-end engine tests on the CPU backend: the stories260K golden, the
// ShadowKV policy reproducing full attention when nothing is compressed away,
// a lossy ShadowKV configuration running (and compressing generated tokens),
// and bad input refused with clear errors.
#include <cmath>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/args.h"
#include "common/file.h"
#include "tests/docs_util.h"
#include "tests/test_util.h"
#include "tests/worker/model_test_util.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"
#include "worker/engine/engine_flags.h"

namespace penumbra {
namespace {

class EngineTest : public testing::StoriesTest {};

std::string Stories() { return testing::StoriesDir(); }

std::vector<int32_t> GoldenIds() {
  auto text = ReadFileToString(Stories() + "/golden_greedy.json");
  EXPECT_TRUE(text.ok()) << text.status();
  return nlohmann::json::parse(*text)["greedy_ids"].get<std::vector<int32_t>>();
}

std::unique_ptr<Engine> Open(const EngineOptions& o) {
  auto e = Engine::Open(Stories(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

TEST_F(EngineTest, Stories260KGreedyMatchesGolden) {
  EngineOptions o;
  o.backend.device = "cpu";
  auto e = Open(o);
  ASSERT_NE(e, nullptr);
  GenerationRequest r;
  r.prompt = {1};
  r.max_new_tokens = 200;
  auto res = e->runtime().Generate({r});
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ((*res)[0].ids, GoldenIds());
}

TEST_F(EngineTest, BatchOfDifferentLengthsMatchesSingleRuns) {
  EngineOptions o;
  o.backend.device = "cpu";
  auto e = Open(o);
  ASSERT_NE(e, nullptr);
  const std::vector<int32_t> g = GoldenIds();
  std::vector<GenerationRequest> reqs(3);
  reqs[0].prompt = {1};
  reqs[1].prompt = {1};
  reqs[1].prompt.insert(reqs[1].prompt.end(), g.begin(), g.begin() + 40);
  reqs[2].prompt = {1};
  reqs[2].prompt.insert(reqs[2].prompt.end(), g.begin(), g.begin() + 7);
  for (auto& r : reqs) r.max_new_tokens = 30;
  auto res = e->runtime().Generate(reqs);
  ASSERT_TRUE(res.ok()) << res.status();
  // Greedy continuation of the model's own output is the golden's next ids.
  EXPECT_EQ((*res)[0].ids, std::vector<int32_t>(g.begin(), g.begin() + 30));
  EXPECT_EQ((*res)[1].ids, std::vector<int32_t>(g.begin() + 40, g.begin() + 70));
  EXPECT_EQ((*res)[2].ids, std::vector<int32_t>(g.begin() + 7, g.begin() + 37));
}

// rank = hkv*d, budget = every chunk, no outliers: ShadowKV must reproduce
// full attention — prefill factors the keys, builds landmarks and offloads
// values; each decode step scores and selects every chunk, rebuilds every K
// from A·B with RoPE and fetches every V from the store. The comparison runs
// until generated tokens would form a new chunk (beyond the fixed budget the
// policy is sparse by design; the next test covers that regime).
TEST_F(EngineTest, ShadowKvAtFullRankAndBudgetIsExact) {
  const std::vector<int32_t> g = GoldenIds();
  std::vector<int32_t> prompt = {1};
  prompt.insert(prompt.end(), g.begin(), g.begin() + 151);  // 152 = 11 chunks of 8 + a 64-token window
  auto run = [&](const std::string& policy, int rank, int budget, int outliers, std::vector<float>* last_logits) {
    EngineOptions o;
    o.backend.device = "cpu";
    o.kv_policy = policy;
    o.shadowkv.rank = rank;
    o.shadowkv.budget_tokens = budget;
    o.shadowkv.outlier_chunks = outliers;
    o.shadowkv.min_prompt_tokens = 0;
    o.shadowkv.local_window = 64;
    auto e = Open(o);
    if (e == nullptr) return std::vector<int32_t>{};  // Open reported the failure
    Runtime& rt = e->runtime();
    std::vector<int32_t> ids;
    std::vector<int64_t> seq = {0};
    EXPECT_TRUE(rt.AddSequence(0, prompt.size(), 64).ok());
    std::vector<float> logits;
    EXPECT_TRUE(rt.Prefill(0, prompt, &logits).ok());
    int32_t tok = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    ids.push_back(tok);
    const int V = e->config().vocab_size;
    for (int i = 0; i < 8; ++i) {
      auto l = rt.DecodeStep(seq, {tok}, {static_cast<int64_t>(prompt.size() + i)});
      EXPECT_TRUE(l.ok()) << l.status();
      last_logits->insert(last_logits->end(), *l, *l + V);
      const float* row = *l;
      tok = static_cast<int32_t>(std::max_element(row, row + V) - row);
      ids.push_back(tok);
    }
    return ids;
  };
  std::vector<float> full_logits, skv_logits;
  const auto full = run("full", 0, 8, 0, &full_logits);
  const auto skv = run("shadowkv", 32, 4096, 0, &skv_logits);
  EXPECT_EQ(full, std::vector<int32_t>(g.begin() + 151, g.begin() + 160));
  EXPECT_EQ(skv, full);
  // f32 rounding only: the SVD reconstruction at full rank is exact up to ~1e-6.
  EXPECT_TRUE(testing::AllClose(skv_logits, full_logits, 1e-4f, 1e-4f));
}

TEST_F(EngineTest, ShadowKvLossySettingsRunAndCompressGeneratedTokens) {
  EngineOptions o;
  o.backend.device = "cpu";
  o.kv_policy = "shadowkv";
  o.shadowkv.rank = 12;
  o.shadowkv.budget_tokens = 48;
  o.shadowkv.outlier_chunks = 2;
  o.shadowkv.min_prompt_tokens = 0;
  o.shadowkv.local_window = 8;
  auto e = Open(o);
  ASSERT_NE(e, nullptr);
  const std::vector<int32_t> g = GoldenIds();
  GenerationRequest r;
  r.prompt = {1};
  r.prompt.insert(r.prompt.end(), g.begin(), g.begin() + 200);
  r.max_new_tokens = 250;  // far past the local window: chunks of new tokens join the pool
  auto res = e->runtime().Generate({r});
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ((*res)[0].ids.size(), 250u);
  const PolicyStats st = e->runtime().policy().stats();
  EXPECT_GT(st.selected_chunks, 0);
  EXPECT_GE(st.hit_rate(), 0.0);
}

// outlier_fraction scales the outlier count with the prompt: 201 tokens,
// window 8 -> 24 prompt chunks; ceil(0.05 * 24) = 2 outliers, the same policy
// as outlier_chunks = 2, so the same tokens come out.
TEST_F(EngineTest, ShadowKvOutlierFractionMatchesTheEquivalentCount) {
  auto run = [](int outliers, double fraction) {
    EngineOptions o;
    o.backend.device = "cpu";
    o.kv_policy = "shadowkv";
    o.shadowkv.rank = 12;
    o.shadowkv.budget_tokens = 48;
    o.shadowkv.outlier_chunks = outliers;
    o.shadowkv.outlier_fraction = fraction;
    o.shadowkv.min_prompt_tokens = 0;
    o.shadowkv.local_window = 8;
    auto e = Open(o);
    if (e == nullptr) return std::vector<int32_t>{};  // Open reported the failure
    const std::vector<int32_t> g = GoldenIds();
    GenerationRequest r;
    r.prompt = {1};
    r.prompt.insert(r.prompt.end(), g.begin(), g.begin() + 200);
    r.max_new_tokens = 40;
    auto res = e->runtime().Generate({r});
    EXPECT_TRUE(res.ok()) << res.status();
    return res.ok() ? (*res)[0].ids : std::vector<int32_t>{};
  };
  const auto by_count = run(2, 0.0);
  ASSERT_EQ(by_count.size(), 40u);
  EXPECT_EQ(run(48, 0.05), by_count);  // the fraction overrides outlier_chunks

  EngineOptions bad;
  bad.backend.device = "cpu";
  bad.kv_policy = "shadowkv";
  bad.shadowkv.rank = 16;
  bad.shadowkv.outlier_fraction = 1.0;
  auto e = Engine::Open(Stories(), bad);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("outlier_fraction"), std::string::npos) << e.status();
}

TEST_F(EngineTest, BadRequestsAreRefusedWithClearErrors) {
  EngineOptions o;
  o.backend.device = "cpu";
  auto e = Open(o);
  ASSERT_NE(e, nullptr);
  Runtime& rt = e->runtime();
  auto expect_error = [&](GenerationRequest r, const std::string& what) {
    auto res = rt.Generate({r});
    ASSERT_FALSE(res.ok());
    EXPECT_EQ(res.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(res.status().message().find(what), std::string::npos) << res.status();
  };
  GenerationRequest empty;
  expect_error(empty, "the prompt is empty");
  GenerationRequest unknown;
  unknown.prompt = {1, 9999};
  expect_error(unknown, "token id 9999 at prompt position 1 is outside the vocabulary");
  GenerationRequest too_long;
  too_long.prompt.assign(500, 1);
  too_long.max_new_tokens = 100;
  expect_error(too_long, "exceeds the model's 512-token context");
  auto with_sampling = [](float temperature, int top_k, float top_p) {
    GenerationRequest r;
    r.prompt = {1};
    r.sampling = {temperature, top_k, top_p, 0};
    return r;
  };
  expect_error(with_sampling(-1.0f, 0, 1.0f), "temperature must be in [0, 100], got -1");
  expect_error(with_sampling(std::nanf(""), 0, 1.0f), "temperature must be in [0, 100]");
  expect_error(with_sampling(0.0f, 0, 2.0f), "top_p must be in (0, 1], got 2");  // checked when greedy too
  expect_error(with_sampling(0.7f, -1, 1.0f), "top_k must be in [0, 2147483647], got -1");
  GenerationRequest bad_stop;
  bad_stop.prompt = {1};
  bad_stop.stop_ids = {2, 512};
  expect_error(bad_stop, "stop id 512 is outside the vocabulary [0, 512)");
  // The runtime still serves after refusing.
  GenerationRequest ok;
  ok.prompt = {1};
  ok.max_new_tokens = 3;
  EXPECT_TRUE(rt.Generate({ok}).ok());
}

TEST_F(EngineTest, ImpossibleShadowKvOptionsAreRefused) {
  EngineOptions o;
  o.backend.device = "cpu";
  o.kv_policy = "shadowkv";
  o.shadowkv.rank = 33;  // > hkv*d = 32
  auto e = Engine::Open(Stories(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("shadowkv.rank"), std::string::npos) << e.status();
  o.shadowkv.rank = 16;
  o.shadowkv.budget_tokens = 12;  // not a multiple of chunk_size 8
  e = Engine::Open(Stories(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("budget_tokens"), std::string::npos) << e.status();
}

// A budget that is a fraction of the prompt grows with it: past the 4096
// chunks a selection takes (the GPU's top-k; the CPU keeps the same limit)
// the request is refused with a typed error and the engine keeps serving.
TEST_F(EngineTest, ABudgetFractionPastTheSelectionLimitRefusesTheRequest) {
  testing::TempDir dir;
  testing::TinyModelSpec spec;
  spec.max_positions = 8192;
  testing::WriteModel(dir, spec, testing::TinyModelTensors(spec));
  EngineOptions o;
  o.backend.device = "cpu";
  o.kv_policy = "shadowkv";
  o.shadowkv.rank = 4;  // hkv * d
  o.shadowkv.chunk_size = 1;
  o.shadowkv.landmarks_per_chunk = 1;
  o.shadowkv.budget_fraction = 0.95;
  o.shadowkv.min_prompt_tokens = 64;
  auto e = Engine::Open(dir.path(), o);
  ASSERT_TRUE(e.ok()) << e.status();
  GenerationRequest big;
  big.prompt = testing::LcgTokens(4600, 3, false);
  for (int32_t& t : big.prompt) t %= spec.vocab;
  big.max_new_tokens = 2;
  auto r = (*e)->runtime().Generate({big});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("lower shadowkv.budget_fraction"), std::string::npos) << r.status();
  GenerationRequest small = big;
  small.prompt.resize(1000);  // 950 chunks selected
  auto ok = (*e)->runtime().Generate({small});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)[0].ids.size(), 2u);
}

TEST_F(EngineTest, EngineYamlNamesBadKeys) {
  auto r = ConfigReader::FromString("kv_policy: shadowkv\nshadowkv:\n  rnak: 3\n", "e.yaml");
  ASSERT_TRUE(r.ok());
  EngineOptions o;
  Status s = LoadEngineOptions(*r, &o);
  EXPECT_NE(s.message().find("shadowkv.rnak: unknown key"), std::string::npos) << s;
}

TEST_F(EngineTest, StorageYamlStillReadsTheMemoryTiersFormerName) {
  auto r = ConfigReader::FromString("storage:\n  dram:\n    device_bytes: 2048\n    host_bytes: 64\n", "e.yaml");
  ASSERT_TRUE(r.ok());
  EngineOptions o;
  Status loaded = LoadEngineOptions(*r, &o);
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(o.runtime.prefix_cache_bytes, 2048u);
  EXPECT_EQ(o.runtime.prefix_cache_host_bytes, 64u);
}

TEST_F(EngineTest, StorageYamlReadsTheTiersAndNamesBadKeys) {
  auto r = ConfigReader::FromString(
      "storage:\n"
      "  gpu:\n    capacity_bytes: 1073741824\n    reserve_bytes: 0\n    high_watermark: 0.9\n"
      "    low_watermark: 0.5\n    promote_min_reads: 7\n    heat_half_life_steps: 3\n    replace_ratio: 4\n"
      "  memory:\n    device_bytes: 1048576\n    host_bytes: 4096\n    low_watermark: 0.75\n"
      "  disk:\n    path: /tmp/x\n    capacity_bytes: 2000000\n    block_bytes: 65536\n    sync_commit: false\n"
      "    queue_bytes: 123456\n    lazy_reads: false\n    lazy_block_bytes: 8192\n    lazy_threads: 5\n",
      "e.yaml");
  ASSERT_TRUE(r.ok());
  EngineOptions o;
  Status loaded = LoadEngineOptions(*r, &o);
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(o.runtime.tiers.gpu_capacity_bytes, size_t{1} << 30);
  EXPECT_EQ(o.runtime.tiers.gpu_reserve_bytes, 0u);
  EXPECT_DOUBLE_EQ(o.runtime.tiers.gpu_high_watermark, 0.9);
  EXPECT_DOUBLE_EQ(o.runtime.tiers.gpu_low_watermark, 0.5);
  EXPECT_EQ(o.runtime.tiers.promote_min_reads, 7);
  EXPECT_DOUBLE_EQ(o.runtime.tiers.heat_half_life_steps, 3);
  EXPECT_DOUBLE_EQ(o.runtime.tiers.replace_ratio, 4);
  EXPECT_EQ(o.runtime.prefix_cache_bytes, 1048576u);
  EXPECT_EQ(o.runtime.prefix_cache_host_bytes, 4096u);
  EXPECT_DOUBLE_EQ(o.runtime.prefix_cache_low_watermark, 0.75);
  EXPECT_EQ(o.prefix_store.path, "/tmp/x");
  EXPECT_EQ(o.prefix_store.capacity_bytes, 2000000u);
  EXPECT_EQ(o.prefix_store.block_bytes, 65536u);
  EXPECT_FALSE(o.prefix_store.sync_commit);
  EXPECT_EQ(o.runtime.prefix_store_queue_bytes, 123456u);
  EXPECT_FALSE(o.runtime.prefix_store_lazy_reads);
  EXPECT_EQ(o.runtime.prefix_store_lazy_block_bytes, 8192u);
  EXPECT_EQ(o.runtime.prefix_store_lazy_threads, 5);
  for (const auto& [yaml, want] : std::vector<std::pair<std::string, std::string>>{
           {"storage:\n  disk:\n    block_bytes: 100\n", "storage.disk.block_bytes"},
           {"storage:\n  disk:\n    capcity_bytes: 1\n", "storage.disk.capcity_bytes: unknown key"},
           {"storage:\n  disk:\n    lazy_block_bytes: 1073741824\n", "storage.disk.lazy_block_bytes"},
           {"storage:\n  memory:\n    device_bytes: -1\n", "storage.memory.device_bytes"},
           {"storage:\n  dram:\n    device_bytes: -1\n", "storage.dram.device_bytes"},
           {"storage:\n  memory: {}\n  dram: {}\n", "storage.dram: is the former name of `memory`"},
           {"storage:\n  memory:\n    host_bytes: x\n", "storage.memory.host_bytes"},
           {"storage:\n  gpu:\n    low_watermark: 0.9\n    high_watermark: 0.5\n", "storage.gpu.low_watermark"},
           {"storage:\n  gpu:\n    replace_ratio: 0.5\n", "storage.gpu.replace_ratio"},
           {"storage:\n  tape: {}\n", "storage.tape: unknown key"},
           {"prefix_cache_bytes: 1\n", "prefix_cache_bytes: unknown key"}}) {
    auto bad = ConfigReader::FromString(yaml, "e.yaml");
    ASSERT_TRUE(bad.ok());
    EngineOptions b;
    Status st = LoadEngineOptions(*bad, &b);
    EXPECT_NE(st.message().find(want), std::string::npos) << yaml << " -> " << st;
  }
  // The shipped configs load; configs/storage.yaml states the defaults.
  auto e = LoadEngineOptionsFile(testing::SourceDir() + "/configs/engine.yaml");
  ASSERT_TRUE(e.ok()) << e.status();
  EngineOptions shipped = *e;
  Status st = LoadStorageOptionsFile(testing::SourceDir() + "/configs/storage.yaml", &shipped);
  ASSERT_TRUE(st.ok()) << st;
  const EngineOptions defaults;
  EXPECT_EQ(shipped.runtime.tiers.gpu_capacity_bytes, defaults.runtime.tiers.gpu_capacity_bytes);
  EXPECT_EQ(shipped.runtime.tiers.gpu_reserve_bytes, defaults.runtime.tiers.gpu_reserve_bytes);
  EXPECT_EQ(shipped.runtime.tiers.promote_min_reads, defaults.runtime.tiers.promote_min_reads);
  EXPECT_EQ(shipped.runtime.prefix_cache_bytes, defaults.runtime.prefix_cache_bytes);
  EXPECT_EQ(shipped.runtime.prefix_store_queue_bytes, defaults.runtime.prefix_store_queue_bytes);
  EXPECT_EQ(shipped.runtime.prefix_store_lazy_block_bytes, defaults.runtime.prefix_store_lazy_block_bytes);
  EXPECT_EQ(shipped.prefix_store.capacity_bytes, defaults.prefix_store.capacity_bytes);
  EXPECT_EQ(shipped.prefix_store.block_bytes, defaults.prefix_store.block_bytes);
  EXPECT_EQ(shipped.prefix_store.read_threads, defaults.prefix_store.read_threads);
  // configs/engine.yaml's policy sections state the defaults too.
  EXPECT_EQ(shipped.shadowkv.value_format, defaults.shadowkv.value_format);
  const SpindleKvOptions& sk = shipped.spindlekv;
  const SpindleKvOptions& skd = defaults.spindlekv;
  EXPECT_EQ(sk.reserve_ratio, skd.reserve_ratio);
  EXPECT_EQ(sk.min_ratio, skd.min_ratio);
  EXPECT_EQ(sk.window, skd.window);
  EXPECT_EQ(sk.pool, skd.pool);
  EXPECT_EQ(sk.key_threshold, skd.key_threshold);
  EXPECT_EQ(sk.value_threshold, skd.value_threshold);
  EXPECT_EQ(sk.codebook_block, skd.codebook_block);
  EXPECT_EQ(sk.merge_window, skd.merge_window);
  EXPECT_EQ(sk.min_prompt_tokens, skd.min_prompt_tokens);
  const SpeContextOptions& sc = shipped.specontext;
  const SpeContextOptions& scd = defaults.specontext;
  EXPECT_EQ(sc.budget, scd.budget);
  EXPECT_EQ(sc.local, scd.local);
  EXPECT_EQ(sc.successors, scd.successors);
  EXPECT_EQ(sc.observe, scd.observe);
  EXPECT_EQ(sc.head, scd.head);
  EXPECT_EQ(sc.device_layers, scd.device_layers);
  EXPECT_EQ(sc.device_reserve_bytes, scd.device_reserve_bytes);
  EXPECT_EQ(sc.yarn_factor, scd.yarn_factor);
  Status missing = LoadStorageOptionsFile("/nonexistent/storage.yaml", &shipped);
  EXPECT_FALSE(missing.ok());
}

TEST_F(EngineTest, EngineYamlReadsLinearAndChainedLaunch) {
  auto r = ConfigReader::FromString("linear: cublas\nchained_launch: false\n", "e.yaml");
  ASSERT_TRUE(r.ok());
  EngineOptions o;
  ASSERT_TRUE(LoadEngineOptions(*r, &o).ok());
  EXPECT_EQ(o.backend.linear, "cublas");
  EXPECT_FALSE(o.backend.chained_launch);
  auto skinny = ConfigReader::FromString("linear: skinny\n", "e.yaml");
  ASSERT_TRUE(skinny.ok());
  EngineOptions o1;
  ASSERT_TRUE(LoadEngineOptions(*skinny, &o1).ok());
  EXPECT_EQ(o1.backend.linear, "skinny");
  auto bad = ConfigReader::FromString("linear: fast\n", "e.yaml");
  ASSERT_TRUE(bad.ok());
  EngineOptions o2;
  Status s = LoadEngineOptions(*bad, &o2);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("linear"), std::string::npos) << s;
}

TEST_F(EngineTest, UnknownLinearKernelIsRefusedOnEveryDevice) {
  BackendOptions o;
  o.device = "cpu";
  o.linear = "fast";
  auto b = CreateBackend(o);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("unknown linear kernel 'fast'"), std::string::npos) << b.status();
  o.linear = "skinny";
  EXPECT_TRUE(CreateBackend(o).ok());
}

TEST_F(EngineTest, OnOffFlagsAreParsedOrRefused) {
  Args a;
  a.Flag("chained-launch", "").Flag("fetch-turns", "").Flag("other", "");
  const char* argv[] = {"penumbra", "cmd", "--chained-launch", "off", "--fetch-turns", "yes"};
  ASSERT_TRUE(a.Parse(6, const_cast<char**>(argv), 2).ok());
  auto off = a.GetOnOff("chained-launch", true);
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(*off);
  auto def = a.GetOnOff("other", true);
  ASSERT_TRUE(def.ok());
  EXPECT_TRUE(*def);
  auto bad = a.GetOnOff("fetch-turns", true);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--fetch-turns"), std::string::npos) << bad.status();
}

// docs/operations.md's table of the engine's options is the table's own.
TEST(EngineOptionTableTest, TheDocsTableIsTheOptionTable) {
  EXPECT_TRUE(testing::GeneratedDocSectionIs("docs/operations.md", "engine options", EngineOptionTable().Markdown()));
}

}  // namespace
}  // namespace penumbra
