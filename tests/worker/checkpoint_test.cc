#include "worker/model/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/file.h"
#include "tests/test_util.h"
#include "tests/worker/model_test_util.h"

namespace penumbra {
namespace {

using nlohmann::json;
using testing::BuildSafetensors;
using testing::RampTensor;
using testing::TempDir;
using testing::TestTensor;
using testing::TinyConfigJson;
using testing::TinyModelSpec;
using testing::TinyModelTensors;
using testing::WriteModel;
using testing::WriteStringToFile;

// Splits `tensors` round-robin over `shards` files plus an index, as
// save_pretrained does with a small max_shard_size.
void WriteShardedModel(const TempDir& dir, const TinyModelSpec& spec, const std::vector<TestTensor>& tensors,
                       int shards) {
  WriteStringToFile(dir.File("config.json"), TinyConfigJson(spec).dump(2));
  std::vector<std::vector<TestTensor>> parts(static_cast<size_t>(shards));
  json weight_map = json::object();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t s = i % static_cast<size_t>(shards);
    parts[s].push_back(tensors[i]);
    weight_map[tensors[i].name] =
        "model-0000" + std::to_string(s + 1) + "-of-0000" + std::to_string(shards) + ".safetensors";
  }
  for (size_t s = 0; s < parts.size(); ++s) {
    WriteStringToFile(
        dir.File("model-0000" + std::to_string(s + 1) + "-of-0000" + std::to_string(shards) + ".safetensors"),
        BuildSafetensors(parts[s]));
  }
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}};
  WriteStringToFile(dir.File("model.safetensors.index.json"), index.dump(2));
}

std::vector<TestTensor> Without(std::vector<TestTensor> tensors, const std::string& name) {
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [&](const TestTensor& t) { return t.name == name; }),
                tensors.end());
  return tensors;
}

void ExpectStatus(const Status& s, StatusCode code, std::initializer_list<std::string> mentions) {
  EXPECT_EQ(s.code(), code) << s;
  for (const std::string& m : mentions) EXPECT_HAS_SUBSTR(s.message(), m);
}

TEST(CheckpointTest, OpensSingleFileAndValidates) {
  TempDir dir;
  TinyModelSpec spec;
  WriteModel(dir, spec, TinyModelTensors(spec));
  Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->dir(), dir.path());
  EXPECT_EQ(ckpt->config().hidden_size, 8);
  EXPECT_EQ(ckpt->files().size(), 1u);
  EXPECT_TRUE(ckpt->Validate().ok()) << ckpt->Validate();
  EXPECT_TRUE(ckpt->Has("lm_head.weight"));
  EXPECT_FALSE(ckpt->Has("lm_head.bias"));
  EXPECT_EQ(ckpt->TensorNames().size(), TinyModelTensors(spec).size());

  Result<const TensorInfo*> q = ckpt->Get("model.layers.1.self_attn.q_proj.weight", {8, 8});
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ((*q)->dtype, DType::kF32);
  float v;
  std::memcpy(&v, (*q)->data + 4 * 3, 4);
  EXPECT_FLOAT_EQ(v, 0.03f);
  EXPECT_EQ((*q)->file, dir.File("model.safetensors"));
}

TEST(CheckpointTest, WrongShapeNamesTensorFileAndShapes) {
  TempDir dir;
  TinyModelSpec spec;
  WriteModel(dir, spec, TinyModelTensors(spec));
  Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  Result<const TensorInfo*> t = ckpt->Get("model.layers.0.self_attn.k_proj.weight", {8, 8});
  ASSERT_FALSE(t.ok());
  ExpectStatus(t.status(), StatusCode::kInvalidArgument,
               {"'model.layers.0.self_attn.k_proj.weight'", "model.safetensors", "[4, 8]", "expected [8, 8]"});
  t = ckpt->Get("model.layers.9.mlp.up_proj.weight", {12, 8});
  ASSERT_FALSE(t.ok());
  ExpectStatus(t.status(), StatusCode::kNotFound, {"'model.layers.9.mlp.up_proj.weight'", dir.path()});

  // A checkpoint whose stored shape disagrees with config.json fails Validate.
  std::vector<TestTensor> tensors = Without(TinyModelTensors(spec), "model.layers.1.mlp.down_proj.weight");
  tensors.push_back(RampTensor("model.layers.1.mlp.down_proj.weight", {12, 8}));  // transposed
  TempDir dir2;
  WriteModel(dir2, spec, tensors);
  ckpt = Checkpoint::Open(dir2.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ExpectStatus(ckpt->Validate(), StatusCode::kInvalidArgument,
               {"'model.layers.1.mlp.down_proj.weight'", "[12, 8]", "expected [8, 12]", "model.safetensors"});
}

TEST(CheckpointTest, MissingTensorFailsValidate) {
  TinyModelSpec spec;
  for (const std::string name : {"model.embed_tokens.weight", "model.layers.1.input_layernorm.weight",
                                 "model.layers.0.self_attn.v_proj.weight", "model.norm.weight", "lm_head.weight"}) {
    SCOPED_TRACE(name);
    TempDir dir;
    WriteModel(dir, spec, Without(TinyModelTensors(spec), name));
    Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    ExpectStatus(ckpt->Validate(), StatusCode::kNotFound, {"'" + name + "'", dir.path()});
  }
}

TEST(CheckpointTest, TiedEmbeddings) {
  TinyModelSpec spec;
  spec.tie_word_embeddings = true;
  TempDir dir;
  WriteModel(dir, spec, TinyModelTensors(spec));
  Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_FALSE(ckpt->Has("lm_head.weight"));
  EXPECT_TRUE(ckpt->Validate().ok()) << ckpt->Validate();

  // Tied with a redundant lm_head copy is fine too.
  TinyModelSpec untied = spec;
  untied.tie_word_embeddings = false;
  TempDir dir2;
  WriteModel(dir2, spec, TinyModelTensors(untied));
  ckpt = Checkpoint::Open(dir2.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE(ckpt->Validate().ok()) << ckpt->Validate();
}

TEST(CheckpointTest, Qwen2NeedsQkvBiases) {
  TinyModelSpec spec;
  spec.architecture = "Qwen2ForCausalLM";
  spec.qkv_bias = true;
  TempDir dir;
  WriteModel(dir, spec, TinyModelTensors(spec));
  Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE(ckpt->config().attention_bias);
  EXPECT_TRUE(ckpt->Validate().ok()) << ckpt->Validate();

  TempDir dir2;
  WriteModel(dir2, spec, Without(TinyModelTensors(spec), "model.layers.1.self_attn.k_proj.bias"));
  ckpt = Checkpoint::Open(dir2.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ExpectStatus(ckpt->Validate(), StatusCode::kNotFound, {"'model.layers.1.self_attn.k_proj.bias'"});
}

TEST(CheckpointTest, MixedFloatDtypesAllowedIntegerRefused) {
  TinyModelSpec spec;
  std::vector<TestTensor> tensors = TinyModelTensors(spec, "BF16");
  tensors = Without(tensors, "model.norm.weight");
  tensors.push_back(RampTensor("model.norm.weight", {8}, "F32", 1.0f));
  tensors = Without(tensors, "lm_head.weight");
  tensors.push_back(RampTensor("lm_head.weight", {16, 8}, "F16"));
  TempDir dir;
  WriteModel(dir, spec, tensors);
  Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE(ckpt->Validate().ok()) << ckpt->Validate();
  EXPECT_EQ((*ckpt->Get("model.embed_tokens.weight", {16, 8}))->dtype, DType::kBF16);
  EXPECT_EQ((*ckpt->Get("lm_head.weight", {16, 8}))->dtype, DType::kF16);

  tensors = Without(tensors, "model.norm.weight");
  tensors.push_back({"model.norm.weight", "I32", {8}, std::vector<uint8_t>(32, 0)});
  TempDir dir2;
  WriteModel(dir2, spec, tensors);
  ckpt = Checkpoint::Open(dir2.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ExpectStatus(ckpt->Validate(), StatusCode::kInvalidArgument, {"'model.norm.weight'", "I32"});
}

TEST(CheckpointTest, ShardedViaIndex) {
  TinyModelSpec spec;
  TempDir dir;
  WriteShardedModel(dir, spec, TinyModelTensors(spec), 3);
  Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->files().size(), 3u);
  EXPECT_TRUE(ckpt->Validate().ok()) << ckpt->Validate();
  Result<const TensorInfo*> t = ckpt->Get("model.embed_tokens.weight", {16, 8});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->file, dir.File("model-00001-of-00003.safetensors"));
  t = ckpt->Get("model.layers.0.input_layernorm.weight", {8});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->file, dir.File("model-00002-of-00003.safetensors"));
  float v;
  std::memcpy(&v, (*t)->data + 4, 4);
  EXPECT_FLOAT_EQ(v, 1.01f);
}

TEST(CheckpointTest, ShardErrors) {
  TinyModelSpec spec;
  {
    // A shard named by the index is missing.
    TempDir dir;
    WriteShardedModel(dir, spec, TinyModelTensors(spec), 2);
    std::filesystem::remove(dir.File("model-00002-of-00002.safetensors"));
    Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
    ASSERT_FALSE(ckpt.ok());
    ExpectStatus(ckpt.status(), StatusCode::kNotFound, {"model-00002-of-00002.safetensors", "index.json"});
  }
  {
    // The index places a tensor in a shard that does not hold it.
    TempDir dir;
    WriteShardedModel(dir, spec, TinyModelTensors(spec), 2);
    json index = json::parse(*ReadFileToString(dir.File("model.safetensors.index.json")));
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors";
    index["weight_map"]["model.layers.0.input_layernorm.weight"] = "model-00001-of-00002.safetensors";
    WriteStringToFile(dir.File("model.safetensors.index.json"), index.dump());
    Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
    ASSERT_FALSE(ckpt.ok());
    ExpectStatus(ckpt.status(), StatusCode::kCorruption, {"model-00001-of-00002.safetensors", "lacks it"});
  }
  {
    // A corrupt shard is reported with the shard's path.
    TempDir dir;
    WriteShardedModel(dir, spec, TinyModelTensors(spec), 2);
    WriteStringToFile(dir.File("model-00001-of-00002.safetensors"), std::string("\x02\0\0\0\0\0\0\0{", 9));
    Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
    ASSERT_FALSE(ckpt.ok());
    ExpectStatus(ckpt.status(), StatusCode::kCorruption, {dir.File("model-00001-of-00002.safetensors")});
  }
  for (const std::string bad_index : {"{", "{\"weight_map\": 3}", "{\"weight_map\": {\"a\": 1}}",
                                      "{\"weight_map\": {\"a\": \"../x.safetensors\"}}", "{\"weight_map\": {}}"}) {
    SCOPED_TRACE(bad_index);
    TempDir dir;
    WriteStringToFile(dir.File("config.json"), TinyConfigJson(spec).dump());
    WriteStringToFile(dir.File("model.safetensors.index.json"), bad_index);
    Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
    ASSERT_FALSE(ckpt.ok());
    ExpectStatus(ckpt.status(), StatusCode::kCorruption, {"model.safetensors.index.json"});
  }
}

TEST(CheckpointTest, MissingFilesAndBadConfig) {
  TinyModelSpec spec;
  {
    TempDir dir;
    Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
    ASSERT_FALSE(ckpt.ok());
    ExpectStatus(ckpt.status(), StatusCode::kNotFound, {"config.json"});
  }
  {
    TempDir dir;
    WriteStringToFile(dir.File("config.json"), TinyConfigJson(spec).dump());
    Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
    ASSERT_FALSE(ckpt.ok());
    ExpectStatus(ckpt.status(), StatusCode::kNotFound, {"model.safetensors", dir.path()});
  }
  {
    TempDir dir;
    WriteModel(dir, spec, TinyModelTensors(spec));
    json config = TinyConfigJson(spec);
    config["num_key_value_heads"] = 3;
    WriteStringToFile(dir.File("config.json"), config.dump());
    Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
    ASSERT_FALSE(ckpt.ok());
    ExpectStatus(ckpt.status(), StatusCode::kInvalidArgument, {dir.File("config.json"), "'num_key_value_heads'"});
  }
  {
    TempDir dir;
    WriteModel(dir, spec, TinyModelTensors(spec));
    std::string bytes = BuildSafetensors(TinyModelTensors(spec));
    bytes.resize(bytes.size() / 2);
    WriteStringToFile(dir.File("model.safetensors"), bytes);
    Result<Checkpoint> ckpt = Checkpoint::Open(dir.path());
    ASSERT_FALSE(ckpt.ok());
    ExpectStatus(ckpt.status(), StatusCode::kCorruption, {dir.File("model.safetensors")});
  }
}

TEST(CheckpointTest, Stories260K) {
  const std::string dir = testing::StoriesDir();
  Result<Checkpoint> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE(ckpt->config().tie_word_embeddings);
  EXPECT_TRUE(ckpt->Validate().ok()) << ckpt->Validate();
  EXPECT_FALSE(ckpt->Has("lm_head.weight"));
  Result<const TensorInfo*> emb = ckpt->Get("model.embed_tokens.weight", {512, 64});
  ASSERT_TRUE(emb.ok()) << emb.status();
  EXPECT_EQ((*emb)->dtype, DType::kF32);
  EXPECT_EQ((*emb)->bytes, 512u * 64u * 4u);
  // 5 layers x 9 tensors + embedding + final norm.
  EXPECT_EQ(ckpt->TensorNames().size(), 5u * 9u + 2u);
}

}  // namespace
}  // namespace penumbra
