// SpeContext's lightweight retrieval head (the SpeContext paper, section 4):
// what is left of a distilled one-layer language model once everything but
// what its attention weights need is pruned: the token embedding (the target
// model's own table, which the draft shares), the layer's input RMSNorm and
// its query and key projections, with RoPE. For each token it gives the
// query rows (to score the context with) and the key rows (the head's own K
// cache of the whole context); worker/engine/specontext_policy.cc selects
// the tokens every layer of the model attends to from their attention
// weights.
//
// File format (head.safetensors; ops/evalmodel/train_specontext_head.py
// writes it): bf16 or f32 tensors
//   norm.weight   [hidden]
//   q_proj.weight [num_heads * head_dim, hidden]
//   k_proj.weight [num_kv_heads * head_dim, hidden]
// and __metadata__ strings: format = "penumbra-specontext-head v1",
// hidden_size, num_heads, num_kv_heads, head_dim, rope_theta, rms_norm_eps,
// vocab_size, trained_context, embedding = "target". The head's KV heads
// must be the model's (its selection is per KV head of the model), its hidden
// size and vocabulary the model's (it reads the model's embedding table).
//
// Long contexts: the head's positions are scaled by YaRN (NTK-by-parts
// frequencies and the attention temperature 0.1 ln(s) + 1, training-free) by
// a factor s: by default per sequence, its length over the head's trained
// context (1, plain RoPE, for sequences the head was trained on).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "worker/engine/backend.h"
#include "worker/model/model_config.h"

namespace penumbra {

// The target model's embedding table on the backend (ModelWeights::embed()).
struct TargetEmbedding {
  const void* table = nullptr;  // [vocab, hidden]
  DType dtype = DType::kF32;
};

// Inverse frequencies [d/2] of RoPE with base `theta` scaled by YaRN by
// `factor` for a model trained on `trained_context` tokens (factor <= 1:
// the plain frequencies). Dimensions whose wavelength fits the trained
// context more than 32 times keep their frequency, those that fit less than
// once are divided by the factor, linearly in between (YaRN's ramp, alpha 1,
// beta 32).
std::vector<float> YarnInvFreq(int d, double theta, double factor, int64_t trained_context);
// YaRN's attention temperature: 0.1 ln(factor) + 1 (1 when factor <= 1),
// applied to queries and keys alike (the logits scale by its square).
double YarnMscale(double factor);

class SpeContextHead {
 public:
  // Loads and validates `path` against the model `target` (InvalidArgument or
  // Corruption naming the file and what does not fit). yarn_factor: 0 = per
  // sequence (Factor), else that factor for every sequence.
  static Result<std::unique_ptr<SpeContextHead>> Load(const std::string& path, const ModelConfig& target,
                                                      TargetEmbedding embed, Backend* backend, double yarn_factor);
  // A head of the model's own attention shape with N(0, 0.02) projections and
  // a unit norm (throughput runs on random weights).
  static Result<std::unique_ptr<SpeContextHead>> Random(const ModelConfig& target, TargetEmbedding embed,
                                                        Backend* backend, uint64_t seed, double yarn_factor);

  int heads() const { return heads_; }
  int kv_heads() const { return kv_heads_; }
  int head_dim() const { return head_dim_; }
  // The YaRN factor of a sequence of `tokens` tokens at most: the fixed one,
  // or max(1, tokens / trained_context).
  double Factor(int64_t tokens) const;
  // The scale of its logits at `factor`: mscale^2 / sqrt(head_dim).
  float Scale(double factor) const;
  int64_t trained_context() const { return trained_context_; }
  // Names the head (its file's content hash, or "random:SEED") for the
  // policy's fingerprint.
  const std::string& identity() const { return identity_; }

  // The head over n tokens (device ids and positions) at YaRN `factor`:
  // their query rows with RoPE, [n][heads][head_dim] act dtype, into q_out
  // (null: not kept), and their key rows with RoPE to k_dst[t] (device array
  // of n addresses of KV head 0's row; head h at + h * head_stride elements).
  Status Project(const int32_t* ids, const int32_t* positions, int n, double factor, void* q_out, void* const* k_dst,
                 int64_t head_stride);
  // The rows one Project call takes at most (the caller splits longer runs).
  static constexpr int kMaxRows = 2048;

 private:
  SpeContextHead() = default;
  Status Finish(TargetEmbedding embed, Backend* backend, const std::vector<float>& norm, const std::vector<float>& qk,
                double rms_eps, double yarn_factor);
  Result<const float*> InvFreq(double factor);

  Backend* backend_ = nullptr;
  TargetEmbedding embed_;
  int hidden_ = 0, heads_ = 0, kv_heads_ = 0, head_dim_ = 0;
  double rope_theta_ = 0, rms_eps_ = 0, yarn_factor_ = 0;  // 0: per sequence
  int64_t trained_context_ = 0;
  std::string identity_;
  DeviceBuffer norm_, proj_;                 // proj_: [q rows; k rows; zero value rows] x hidden
  std::map<double, DeviceBuffer> inv_freq_;  // by YaRN factor
  DeviceBuffer x_, h_, qkv_, q_discard_;     // scratch for kMaxRows rows
};

}  // namespace penumbra
