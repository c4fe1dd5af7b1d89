// SpindleKV attention (worker/engine/spindlekv_policy.cc): the argument
// struct of the kernel that attends a decode step's query heads to the
// tokens their KV head holds in compressed form (plain pointers and ints,
// no CUDA header; the launcher is in spindlekv_attention.cuh, the CPU
// reference in cpu/spindlekv.h).
//
// A (sequence, KV head) holds its tokens in up to two parts (an attached
// document's, then the sequence's own), each token as
//   pos   its position (RoPE is applied to its rebuilt key there),
//   kref, vref  references into the KV head's key and value codebooks (unit
//         vectors [entries][d] of the entry dtype): a reference below
//         *_base_entries reads the document's codebook, else the
//         sequence's own at (reference - *_base_entries),
//   kmag, vmag  the magnitudes the entries are scaled by,
//   heads the mask of the KV head's query heads that attend to it (bit j:
//         query head h * G + j, G = hq / hkv).
// Query head q of the group attends to every token whose mask has its bit:
//   k_t = RoPE(entry_k[kref_t] * kmag_t, pos_t), v_t = entry_v[vref_t] * vmag_t,
//   out_q = sum_t softmax_t(scale q . k_t) v_t.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace penumbra::kernels {

struct SpindlekvTokens {
  const int32_t* pos = nullptr;
  const int32_t* kref = nullptr;
  const int32_t* vref = nullptr;
  const float* kmag = nullptr;
  const float* vmag = nullptr;
  const uint32_t* heads = nullptr;
  int64_t n = 0;
};

struct SpindlekvHead {
  SpindlekvTokens part[2];          // part[0]: an attached document's (n 0: none); part[1]: the sequence's own
  const void* key_entries[2] = {};  // [entries][d]: the document's, the sequence's own
  const void* value_entries[2] = {};
  int32_t key_base_entries = 0, value_base_entries = 0;  // entries in key_entries[0], value_entries[0]
};

// Supported on CUDA: d % 32 == 0, d <= 256, hq % hkv == 0, hq / hkv <= 8.
struct SpindlekvAttentionArgs {
  const void* q = nullptr;               // [batch][hq][d] of dtype, RoPE applied
  const SpindlekvHead* heads = nullptr;  // [batch * hkv], row b * hkv + h (device memory on CUDA)
  const float* inv_freq = nullptr;       // [d / 2] (device)
  void* out = nullptr;                   // [batch][hq][d] of dtype
  float* lse = nullptr;                  // optional [batch][hq]: ln sum exp over the attended tokens (-inf: none)
  DType dtype = DType::kF32;             // q, out and the codebook entries
  int batch = 0, hq = 0, hkv = 0, d = 0;
  float scale = 1.0f;
  // CUDA: tokens of a (sequence, KV head) are split over `splits` blocks,
  // merged by log-sum-exp through `workspace` (SpindlekvWorkspaceFloats
  // floats); max_tokens bounds part[0].n + part[1].n over the rows.
  int splits = 1;
  int64_t max_tokens = 0;
  float* workspace = nullptr;
  // Optional, the CPU reference only: cos and sin of pos * inv_freq,
  // [rope_positions][d / 2], covering every token's position (the same f32
  // values it computes otherwise, without computing them every step).
  const float* rope_cos = nullptr;
  const float* rope_sin = nullptr;
  int64_t rope_positions = 0;
};

// f32 elements of SpindlekvAttentionArgs::workspace for these arguments.
inline size_t SpindlekvWorkspaceFloats(const SpindlekvAttentionArgs& a) {
  return static_cast<size_t>(a.batch) * a.hq * a.splits * (static_cast<size_t>(a.d) + 2);
}

}  // namespace penumbra::kernels
