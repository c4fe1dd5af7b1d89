// Our CPU runtime against Hugging Face transformers: random-weight Llama
// (GQA, llama3 RoPE scaling, sharded), Qwen2 (QKV bias, tied) and Mistral
// (bf16) checkpoints and their logits and greedy ids, made on the GPU machine
// by tests/tools/make_hf_goldens.py and committed under tests/data/models.
#include <cmath>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/file.h"
#include "tests/test_util.h"
#include "worker/engine/engine.h"
#include "worker/model/safetensors.h"

namespace penumbra {
namespace {

struct Golden {
  std::vector<int32_t> prompt, greedy;
  std::vector<float> logits;  // [T, V] fp32 forward
  int64_t T = 0, V = 0;
};

Golden LoadGolden(const std::string& dir) {
  Golden g;
  auto text = ReadFileToString(dir + "/golden.json");
  EXPECT_TRUE(text.ok()) << text.status();
  auto j = nlohmann::json::parse(*text);
  g.prompt = j["prompt_ids"].get<std::vector<int32_t>>();
  g.greedy = j["greedy_fp32"].get<std::vector<int32_t>>();
  auto st = SafetensorsFile::Open(dir + "/goldens.safetensors");
  EXPECT_TRUE(st.ok()) << st.status();
  const TensorInfo* t = st->Find("logits_fp32");
  EXPECT_NE(t, nullptr);
  g.T = t->shape[0];
  g.V = t->shape[1];
  g.logits.resize(g.T * g.V);
  std::memcpy(g.logits.data(), t->data, t->bytes);
  return g;
}

class HfGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(HfGoldenTest, LogitsAndGreedyMatchTransformers) {
  const std::string dir = testing::SourceDir() + "/tests/data/models/" + GetParam();
  Golden g = LoadGolden(dir);
  EngineOptions o;
  o.backend.device = "cpu";
  auto e = Engine::Open(dir, o);
  ASSERT_TRUE(e.ok()) << e.status();
  Runtime& rt = (*e)->runtime();
  // Last-position logits of several prefixes of the prompt.
  for (int64_t n : {int64_t{1}, int64_t{5}, int64_t{17}, g.T}) {
    std::vector<int32_t> p(g.prompt.begin(), g.prompt.begin() + n);
    ASSERT_TRUE(rt.AddSequence(100 + n, n, 1).ok());
    std::vector<float> logits;
    ASSERT_TRUE(rt.Prefill(100 + n, p, &logits).ok());
    rt.RemoveSequence(100 + n);
    EXPECT_TRUE(testing::AllClose(logits.data(), g.logits.data() + (n - 1) * g.V, g.V, 1e-4f, 0.0f))
        << "prefix of " << n << " tokens";
  }
  GenerationRequest req;
  req.prompt = g.prompt;
  req.max_new_tokens = static_cast<int>(g.greedy.size());
  auto res = rt.Generate({req});
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ((*res)[0].ids, g.greedy);
}

INSTANTIATE_TEST_SUITE_P(Models, HfGoldenTest, ::testing::Values("tiny_llama", "tiny_qwen2", "tiny_mistral"));

}  // namespace
}  // namespace penumbra
