// RoPE + KV-cache store, fused: takes the f32 output of the QKV projection,
// applies rotate-half RoPE (HF Llama convention: pairs (i, i + D/2)) to the
// query and key heads at each token's position, writes the queries to q_out
// and scatters keys and values into each token's KV-cache slot.
// Angles are computed in f32 as position * inv_freq[i] (inv_freq already holds
// any llama3 scaling), like Hugging Face does.
#pragma once
#include <cuda_runtime_api.h>
#include <cstdint>
#include "common/dtype.h"

namespace penumbra::kernels {

struct RopeStoreArgs {
  const float* qkv = nullptr;          // [n, (hq + 2*hkv) * d] f32: q heads, then k heads, then v heads
  const int32_t* positions = nullptr;  // [n] device: RoPE position of each token
  const float* inv_freq = nullptr;     // [d/2] device
  int n = 0, hq = 0, hkv = 0, d = 0;
  void* q_out = nullptr;  // [n, hq, d] of q_dtype
  DType q_dtype = DType::kF32;
  // Per token, the address of the slot for KV head 0 in the cache; head h is at
  // +h*head_stride elements. Device arrays of n pointers.
  void* const* k_dst = nullptr;
  void* const* v_dst = nullptr;  // null: values not stored (their qkv columns are still read past)
  int64_t head_stride = 0;       // elements between consecutive KV heads of one sequence
  DType kv_dtype = DType::kBF16;
  // Optional: pre-RoPE keys [n, hkv, d] f32 (for low-rank factorization); may be null.
  float* pre_rope_k_out = nullptr;
  // Optional: per token, the address of an [hkv, d] f32 row for its pre-RoPE
  // keys (device array of n pointers); may be null.
  float* const* pre_rope_k_dst = nullptr;
};

void LaunchRopeStore(const RopeStoreArgs& args, cudaStream_t stream);

}  // namespace penumbra::kernels
