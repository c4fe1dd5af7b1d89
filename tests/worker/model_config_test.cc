#include "worker/model/model_config.h"

#include <cmath>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/test_util.h"
#include "tests/worker/model_test_util.h"

namespace penumbra {
namespace {

using nlohmann::json;
using testing::TinyConfigJson;
using testing::TinyModelSpec;

constexpr char kSource[] = "dir/config.json";

Result<ModelConfig> Parse(const json& j) { return ParseModelConfig(j.dump(), kSource); }

json Llama3Json() {
  json j = TinyConfigJson(TinyModelSpec());
  j["head_dim"] = 128;
  j["num_attention_heads"] = 2;
  j["num_key_value_heads"] = 1;
  j["rope_theta"] = 500000.0;
  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  return j;
}

// Expects an error with `code` whose message names the file and `key`.
void ExpectError(const json& j, StatusCode code, const std::string& key) {
  Result<ModelConfig> c = Parse(j);
  ASSERT_FALSE(c.ok()) << j.dump();
  EXPECT_EQ(c.status().code(), code) << c.status();
  EXPECT_HAS_SUBSTR(c.status().message(), kSource);
  EXPECT_HAS_SUBSTR(c.status().message(), "'" + key + "'");
}

TEST(ModelConfigTest, LoadsStories260K) {
  Result<ModelConfig> c = LoadModelConfig(testing::StoriesDir() + "/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kLlama);
  EXPECT_EQ(c->hidden_size, 64);
  EXPECT_EQ(c->intermediate_size, 172);
  EXPECT_EQ(c->num_layers, 5);
  EXPECT_EQ(c->num_heads, 8);
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_EQ(c->vocab_size, 512);
  EXPECT_EQ(c->max_position_embeddings, 512);
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_EQ(c->rope_scaling.type, "none");
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(c->torch_dtype, DType::kF32);
  EXPECT_EQ(c->sliding_window, 0);
  EXPECT_FALSE(c->use_sliding_window);
}

TEST(ModelConfigTest, MissingFileIsNotFound) {
  Result<ModelConfig> c = LoadModelConfig("/nonexistent/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_HAS_SUBSTR(c.status().message(), "/nonexistent/config.json");
}

TEST(ModelConfigTest, Defaults) {
  json j = TinyConfigJson(TinyModelSpec());
  for (const char* k : {"head_dim", "num_key_value_heads", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                        "bos_token_id", "eos_token_id", "torch_dtype", "hidden_act"}) {
    j.erase(k);
  }
  j["num_attention_heads"] = 4;
  Result<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 2);
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->bos_token_id, -1);
  EXPECT_TRUE(c->eos_token_ids.empty());
  EXPECT_EQ(c->torch_dtype, DType::kF32);
}

TEST(ModelConfigTest, HeadDimMayDifferFromHiddenOverHeads) {
  json j = TinyConfigJson(TinyModelSpec());
  j["head_dim"] = 32;  // 2 heads x 32 = 64 != hidden 8
  Result<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 32);
  EXPECT_EQ(c->q_dim(), 64);
  EXPECT_EQ(c->kv_dim(), 32);
  j["head_dim"] = nullptr;  // Mistral configs write null: fall back to hidden / heads
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 4);
}

TEST(ModelConfigTest, EosAsListAndNull) {
  json j = TinyConfigJson(TinyModelSpec());
  j["eos_token_id"] = {2, 7};
  Result<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{2, 7}));
  j["eos_token_id"] = nullptr;
  j["bos_token_id"] = nullptr;
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->eos_token_ids.empty());
  EXPECT_EQ(c->bos_token_id, -1);
  j["eos_token_id"] = {2, "x"};
  ExpectError(j, StatusCode::kInvalidArgument, "eos_token_id");
  j["eos_token_id"] = 99;  // vocab is 16
  ExpectError(j, StatusCode::kInvalidArgument, "eos_token_id");
}

TEST(ModelConfigTest, DtypeKeys) {
  json j = TinyConfigJson(TinyModelSpec());
  j["torch_dtype"] = "bfloat16";
  EXPECT_EQ(Parse(j)->torch_dtype, DType::kBF16);
  j["torch_dtype"] = "float16";
  EXPECT_EQ(Parse(j)->torch_dtype, DType::kF16);
  j.erase("torch_dtype");
  j["dtype"] = "bfloat16";  // transformers 5.x spelling
  EXPECT_EQ(Parse(j)->torch_dtype, DType::kBF16);
  j["dtype"] = "int8";
  ExpectError(j, StatusCode::kInvalidArgument, "dtype");
}

TEST(ModelConfigTest, Qwen2AndMistral) {
  json j = TinyConfigJson(TinyModelSpec());
  j["architectures"] = {"Qwen2ForCausalLM"};
  j["sliding_window"] = 4096;
  j["use_sliding_window"] = false;
  Result<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kQwen2);
  EXPECT_TRUE(c->attention_bias);
  EXPECT_EQ(c->sliding_window, 4096);
  EXPECT_FALSE(c->use_sliding_window);

  j["architectures"] = {"MistralForCausalLM"};
  j.erase("use_sliding_window");
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kMistral);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->sliding_window, 4096);
  EXPECT_TRUE(c->use_sliding_window);
  j["sliding_window"] = nullptr;
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sliding_window, 0);
  EXPECT_FALSE(c->use_sliding_window);
  EXPECT_EQ(ArchitectureName(Architecture::kMistral), "MistralForCausalLM");
}

TEST(ModelConfigTest, RopeScalingDialects) {
  json j = Llama3Json();
  Result<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 8.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);

  // 4.x legacy key "type".
  j["rope_scaling"].erase("rope_type");
  j["rope_scaling"]["type"] = "llama3";
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, "llama3");

  // 5.x: everything under rope_parameters, theta included.
  json v5 = Llama3Json();
  json params = v5["rope_scaling"];
  params["rope_theta"] = 250000.0;
  v5.erase("rope_scaling");
  v5.erase("rope_theta");
  v5["rope_parameters"] = params;
  c = Parse(v5);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(c->rope_theta, 250000.0);
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};
  c = Parse(v5);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, "none");
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);

  j = TinyConfigJson(TinyModelSpec());
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, "linear");
  j["rope_scaling"] = nullptr;
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, "none");
}

TEST(ModelConfigTest, BadRopeScaling) {
  json j = Llama3Json();
  j["rope_scaling"]["rope_type"] = "yarn";
  ExpectError(j, StatusCode::kInvalidArgument, "rope_scaling.rope_type");
  j["rope_scaling"]["rope_type"] = "dynamic";
  ExpectError(j, StatusCode::kInvalidArgument, "rope_scaling.rope_type");
  j = Llama3Json();
  j["rope_scaling"].erase("factor");
  ExpectError(j, StatusCode::kInvalidArgument, "rope_scaling.factor");
  j = Llama3Json();
  j["rope_scaling"].erase("original_max_position_embeddings");
  ExpectError(j, StatusCode::kInvalidArgument, "rope_scaling.original_max_position_embeddings");
  j = Llama3Json();
  j["rope_scaling"]["high_freq_factor"] = 0.5;
  ExpectError(j, StatusCode::kInvalidArgument, "rope_scaling.high_freq_factor");
  j = Llama3Json();
  j["rope_scaling"] = "llama3";
  ExpectError(j, StatusCode::kInvalidArgument, "rope_scaling");
  j = Llama3Json();
  j["rope_scaling"].erase("rope_type");
  ExpectError(j, StatusCode::kInvalidArgument, "rope_scaling.rope_type");
  j = Llama3Json();
  j["rope_theta"] = "big";
  ExpectError(j, StatusCode::kInvalidArgument, "rope_theta");
}

TEST(ModelConfigTest, InvalidConfigsNameTheKey) {
  const json good = TinyConfigJson(TinyModelSpec());
  ASSERT_TRUE(Parse(good).ok()) << Parse(good).status();
  for (const char* key : {"architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "vocab_size", "max_position_embeddings"}) {
    SCOPED_TRACE(key);
    json j = good;
    j.erase(key);
    ExpectError(j, StatusCode::kInvalidArgument, key);
    j[key] = nullptr;
    ExpectError(j, StatusCode::kInvalidArgument, key);
  }
  json j = good;
  j["architectures"] = {"GPT2LMHeadModel"};
  ExpectError(j, StatusCode::kInvalidArgument, "architectures");
  j["architectures"] = json::array();
  ExpectError(j, StatusCode::kInvalidArgument, "architectures");
  j = good;
  j["num_attention_heads"] = 4;
  j["num_key_value_heads"] = 3;
  ExpectError(j, StatusCode::kInvalidArgument, "num_key_value_heads");
  j = good;
  j["hidden_size"] = -8;
  ExpectError(j, StatusCode::kInvalidArgument, "hidden_size");
  j = good;
  j["hidden_size"] = "8";
  ExpectError(j, StatusCode::kInvalidArgument, "hidden_size");
  j = good;
  j["hidden_size"] = 8.5;
  ExpectError(j, StatusCode::kInvalidArgument, "hidden_size");
  j = good;
  j["num_key_value_heads"] = 0;
  ExpectError(j, StatusCode::kInvalidArgument, "num_key_value_heads");
  j = good;
  j["head_dim"] = 5;
  ExpectError(j, StatusCode::kInvalidArgument, "head_dim");
  j = good;
  j.erase("head_dim");
  j["num_attention_heads"] = 3;
  j["num_key_value_heads"] = 3;
  ExpectError(j, StatusCode::kInvalidArgument, "num_attention_heads");
  j = good;
  j["hidden_act"] = "gelu";
  ExpectError(j, StatusCode::kInvalidArgument, "hidden_act");
  j = good;
  j["mlp_bias"] = true;
  ExpectError(j, StatusCode::kInvalidArgument, "mlp_bias");
  j = good;
  j["attention_bias"] = true;
  ExpectError(j, StatusCode::kInvalidArgument, "attention_bias");
  j = good;
  j["tie_word_embeddings"] = "yes";
  ExpectError(j, StatusCode::kInvalidArgument, "tie_word_embeddings");
  j = good;
  j["rms_norm_eps"] = 0;
  ExpectError(j, StatusCode::kInvalidArgument, "rms_norm_eps");

  for (const std::string text : {"", "{", "[1, 2]", "{\"a\": }"}) {
    Result<ModelConfig> c = ParseModelConfig(text, kSource);
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_HAS_SUBSTR(c.status().message(), kSource);
  }
}

// Values computed in double precision from the llama3 formula (factor 8, low 1,
// high 4, original 8192, theta 500000, d = 128): wavelengths below 2048 keep
// their frequency, above 8192 are divided by 8, and in between interpolate.
TEST(ModelConfigTest, RopeInvFreqLlama3) {
  Result<ModelConfig> c = Parse(Llama3Json());
  ASSERT_TRUE(c.ok()) << c.status();
  const std::vector<float> inv = c->RopeInvFreq();
  ASSERT_EQ(inv.size(), 64u);
  struct Case {
    int i;
    double expected;
  };
  const Case cases[] = {
      {0, 1.0},                      // high frequency: unchanged
      {10, 0.12868737343265052},     // high
      {28, 0.0032114459947525913},   // high (wavelength 1956 < 2048)
      {29, 0.0021665707635033591},   // smooth (wavelength 2402)
      {30, 0.0013718935677611381},   // smooth
      {32, 0.00052484616099295468},  // smooth
      {34, 0.00017850781276799638},  // smooth (wavelength 6695)
      {35, 9.5562123539646833e-05},  // low (wavelength 8219 > 8192): / 8
      {63, 3.0689259889145111e-07},  // low
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.i);
    const double got = inv[static_cast<size_t>(k.i)];
    EXPECT_NEAR(got, k.expected, 2e-6 * k.expected);
  }
}

// The shape of config.json that transformers 5.x writes for tests/tools/make_hf_goldens.py's
// tiny_llama; its RoPE has one pair in each llama3 band.
TEST(ModelConfigTest, TransformersV5TinyLlama) {
  const char* text = R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 1, "dtype": "float32", "eos_token_id": 2, "head_dim": 32, "hidden_act": "silu",
    "hidden_size": 128, "initializer_range": 0.02, "intermediate_size": 256, "max_position_embeddings": 4096,
    "mlp_bias": false, "model_type": "llama", "num_attention_heads": 8, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pad_token_id": null, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_parameters": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                        "original_max_position_embeddings": 64, "rope_theta": 500000.0, "rope_type": "llama3"},
    "tie_word_embeddings": false, "transformers_version": "5.0.0", "use_cache": true, "vocab_size": 1024})";
  Result<ModelConfig> c = ParseModelConfig(text, kSource);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->q_dim(), 256);
  EXPECT_EQ(c->kv_dim(), 64);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 64);
  const std::vector<float> inv = c->RopeInvFreq();
  ASSERT_EQ(inv.size(), 16u);
  const double expected[] = {1.0, 0.44036660267178046, 0.0794030091792082, 0.010674637535720701,
                             0.0047007538663579916};  // high, high, smooth, low, low
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(inv[static_cast<size_t>(i)], expected[i], 2e-6 * expected[i]) << i;
}

TEST(ModelConfigTest, RopeInvFreqDefaultAndLinear) {
  json j = TinyConfigJson(TinyModelSpec());
  j["head_dim"] = 8;
  Result<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<float> inv = c->RopeInvFreq();
  ASSERT_EQ(inv.size(), 4u);
  const std::vector<float> expected = {1.0f, 0.1f, 0.01f, 0.001f};  // 10000^(-2i/8)
  EXPECT_TRUE(testing::AllClose(inv, expected, 0.0f, 1e-6f));
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  inv = c->RopeInvFreq();
  EXPECT_TRUE(testing::AllClose(inv, {0.25f, 0.025f, 0.0025f, 0.00025f}, 0.0f, 1e-6f));
}

}  // namespace
}  // namespace penumbra
