// Test helpers for worker/model: a tiny safetensors writer, temp directories,
// and synthetic Hugging Face model directories.
#pragma once

#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/dtype.h"

// Expects `haystack` (a std::string) to contain `needle`.
#define EXPECT_HAS_SUBSTR(haystack, needle)                        \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "expected \"" << (haystack) << "\" to contain \"" << (needle) << "\""

namespace penumbra::testing {

struct TestTensor {
  std::string name;
  std::string dtype;  // safetensors dtype string: "F32", "BF16", "I8", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline size_t TestDTypeSize(const std::string& dtype) {
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  return 1;
}

// A tensor of `shape` whose element k is start + k * step, stored as `dtype`
// (F32, F16 or BF16).
inline TestTensor RampTensor(const std::string& name, std::vector<int64_t> shape, const std::string& dtype = "F32",
                             float start = 0.0f, float step = 0.01f) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) v[static_cast<size_t>(k)] = start + step * static_cast<float>(k);
  TestTensor t{name, dtype, std::move(shape), {}};
  t.bytes.resize(static_cast<size_t>(n) * TestDTypeSize(dtype));
  DType to = dtype == "F32" ? DType::kF32 : dtype == "F16" ? DType::kF16 : DType::kBF16;
  ConvertFromF32(v.data(), t.bytes.data(), to, v.size());
  return t;
}

// The 8-byte little-endian length, then `header`, then `body`.
inline std::string RawSafetensors(const std::string& header, const std::string& body) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + body;
}

// A well-formed file holding `tensors` back to back in the given order.
inline std::string BuildSafetensors(const std::vector<TestTensor>& tensors, const nlohmann::json& metadata = nullptr) {
  nlohmann::json header = nlohmann::json::object();
  std::string body;
  for (const TestTensor& t : tensors) {
    const uint64_t begin = body.size();
    body.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {begin, body.size()}}};
  }
  if (!metadata.is_null()) header["__metadata__"] = metadata;
  std::string h = header.dump();
  while ((8 + h.size()) % 8 != 0) h += ' ';  // pad like the reference writer
  return RawSafetensors(h, body);
}

inline void WriteStringToFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  ASSERT_TRUE(out) << path;
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  ASSERT_TRUE(out.good()) << path;
}

// A fresh directory under the test temp dir, removed on destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "penumbra_model_XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed for " << tmpl;
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A tiny decoder: hidden 8, intermediate 12, 2 layers, 2 heads, 1 KV head,
// head_dim 4, vocab 16.
struct TinyModelSpec {
  std::string architecture = "LlamaForCausalLM";
  bool tie_word_embeddings = false;
  bool qkv_bias = false;
  int hidden = 8, intermediate = 12, layers = 2, heads = 2, kv_heads = 1, head_dim = 4, vocab = 16;
  int max_positions = 128;
};

inline nlohmann::json TinyConfigJson(const TinyModelSpec& s) {
  return {
      {"architectures", {s.architecture}},
      {"hidden_size", s.hidden},
      {"intermediate_size", s.intermediate},
      {"num_hidden_layers", s.layers},
      {"num_attention_heads", s.heads},
      {"num_key_value_heads", s.kv_heads},
      {"head_dim", s.head_dim},
      {"vocab_size", s.vocab},
      {"max_position_embeddings", s.max_positions},
      {"rope_theta", 10000.0},
      {"rms_norm_eps", 1e-5},
      {"tie_word_embeddings", s.tie_word_embeddings},
      {"hidden_act", "silu"},
      {"bos_token_id", 1},
      {"eos_token_id", 2},
      {"torch_dtype", "float32"},
  };
}

// Every tensor the decoder needs, in HF naming; lm_head omitted when tied.
inline std::vector<TestTensor> TinyModelTensors(const TinyModelSpec& s, const std::string& dtype = "F32") {
  const int64_t h = s.hidden, q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim, in = s.intermediate, v = s.vocab;
  std::vector<TestTensor> t;
  t.push_back(RampTensor("model.embed_tokens.weight", {v, h}, dtype));
  for (int i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    t.push_back(RampTensor(p + "input_layernorm.weight", {h}, dtype, 1.0f));
    t.push_back(RampTensor(p + "self_attn.q_proj.weight", {q, h}, dtype));
    t.push_back(RampTensor(p + "self_attn.k_proj.weight", {kv, h}, dtype));
    t.push_back(RampTensor(p + "self_attn.v_proj.weight", {kv, h}, dtype));
    if (s.qkv_bias) {
      t.push_back(RampTensor(p + "self_attn.q_proj.bias", {q}, dtype));
      t.push_back(RampTensor(p + "self_attn.k_proj.bias", {kv}, dtype));
      t.push_back(RampTensor(p + "self_attn.v_proj.bias", {kv}, dtype));
    }
    t.push_back(RampTensor(p + "self_attn.o_proj.weight", {h, q}, dtype));
    t.push_back(RampTensor(p + "post_attention_layernorm.weight", {h}, dtype, 1.0f));
    t.push_back(RampTensor(p + "mlp.gate_proj.weight", {in, h}, dtype));
    t.push_back(RampTensor(p + "mlp.up_proj.weight", {in, h}, dtype));
    t.push_back(RampTensor(p + "mlp.down_proj.weight", {h, in}, dtype));
  }
  t.push_back(RampTensor("model.norm.weight", {h}, dtype, 1.0f));
  if (!s.tie_word_embeddings) t.push_back(RampTensor("lm_head.weight", {v, h}, dtype));
  return t;
}

// The tiny model's config.json and a single model.safetensors in `dir`.
inline void WriteModel(const TempDir& dir, const TinyModelSpec& spec, const std::vector<TestTensor>& tensors) {
  WriteStringToFile(dir.File("config.json"), TinyConfigJson(spec).dump(2));
  WriteStringToFile(dir.File("model.safetensors"), BuildSafetensors(tensors, {{"format", "pt"}}));
}

}  // namespace penumbra::testing
