// CPU reference implementations of every op in kernels/. f32 math and f32
// tensors throughout; same layouts and semantics as the CUDA launchers (see the
// matching .cuh for the contract). These are the reference the CUDA kernels are
// checked against and the CPU backend's implementation. Functions that loop
// over independent rows may use several threads (ParallelFor).
#pragma once

#include <cstdint>
#include <functional>

namespace penumbra::kernels::cpu {

// Runs fn(i) for i in [0, n) on up to `threads` threads (0 = hardware
// concurrency). Blocks until all are done.
void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn, int threads = 0);

void Embedding(const float* table, const int32_t* ids, int n, int dim, float* out);

void RmsNorm(const float* x, const float* w, int n, int dim, float eps, float* out);

// As kernels::RopeStoreArgs with every tensor f32 and k_dst/v_dst host arrays.
struct RopeStoreArgs {
  const float* qkv = nullptr;
  const int32_t* positions = nullptr;
  const float* inv_freq = nullptr;
  int n = 0, hq = 0, hkv = 0, d = 0;
  float* q_out = nullptr;
  float* const* k_dst = nullptr;
  float* const* v_dst = nullptr;  // null: values not stored
  int64_t head_stride = 0;
  float* pre_rope_k_out = nullptr;         // optional
  float* const* pre_rope_k_dst = nullptr;  // optional, host array of n row addresses
};
void RopeStore(const RopeStoreArgs& a);

// Applies rotate-half RoPE in place to `heads` vectors of dimension d at one
// position (used by RopeStore and by the ShadowKV key rebuild).
void ApplyRope(float* x, int heads, int d, int32_t position, const float* inv_freq);

void SwiGLU(const float* gate_up, int n, int F, float* out);

void AddBias(float* x, const float* bias, int n, int dim);

struct PrefillAttentionArgs {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  float* out = nullptr;
  float* lse = nullptr;  // optional [nq, hq]: ln sum exp(scale q.k)
  int64_t head_stride = 0;
  int q_start = 0, nq = 0, hq = 0, hkv = 0, d = 0;
  float scale = 1.0f;
};
void PrefillAttention(const PrefillAttentionArgs& a);

struct DecodeAttentionArgs {
  const float* q = nullptr;
  const float* const* k = nullptr;
  const float* const* v = nullptr;
  const int32_t* lengths = nullptr;
  float* out = nullptr;
  float* lse = nullptr;  // optional [batch, hq]: ln sum exp(scale q.k)
  int64_t head_stride = 0;
  int batch = 0, hq = 0, hkv = 0, d = 0;
  float scale = 1.0f;
  // Masked rows of empty slots, and slots' V rows read in place
  // (kernels/attention_decode.cuh).
  const int32_t* const* slot_maps = nullptr;
  int slot_row0 = 0, slot_count = 0, slot_rows = 0;
  const float* const* slot_values = nullptr;
  int64_t slot_values_stride = 0;
  int slot_values_chunks = 0;
};
void DecodeAttention(const DecodeAttentionArgs& a);

// Prefix attention (kernels/attention_prefix.cuh): rows rows[0..n) of q
// ([batch, hq, d]) attend to all `keys` keys of one shared K/V block; with
// own_lse the result is merged by log-sum-exp into out (each row's attention
// over its own keys), else it overwrites out.
struct PrefixAttentionArgs {
  const float* q = nullptr;
  const int32_t* rows = nullptr;
  int n = 0;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t head_stride = 0;
  int keys = 0;
  float* out = nullptr;
  const float* own_lse = nullptr;
  float* lse_out = nullptr;  // may alias own_lse
  int hq = 0, hkv = 0, d = 0;
  float scale = 1.0f;
};
void PrefixAttention(const PrefixAttentionArgs& a);

// Same contract as kernels::LaunchMergeAttention (attention_merge.cuh), f32.
void MergeAttention(const float* x, int64_t x_part_stride, const float* lse, int64_t lse_part_stride, int parts,
                    int rows, int d, float* out, float* lse_out);

struct SamplingRow {
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float uniform = 0.0f;
};
// Same contract as kernels::LaunchSample.
int32_t Sample(const float* logits, int vocab, const SamplingRow& p);

}  // namespace penumbra::kernels::cpu
