// Decode attention (one query token per sequence) with GQA over a batch of
// sequences of different lengths, split-K (flash-decoding).
//
// Phase 1: grid (kv head, split, sequence); each block loads its split of K/V
// once and serves all hq/hkv query heads of the group, writing a partial
// output and its log-sum-exp to the workspace. Phase 2 merges the splits.
// Memory bound: reads 2 * sum(lengths) * hkv * d elements once.
#pragma once
#include <cuda_runtime_api.h>
#include <cstddef>
#include <cstdint>
#include "common/dtype.h"

namespace penumbra::kernels {

struct DecodeAttentionArgs {
  const void* q = nullptr;           // [batch, hq, d]
  const void* const* k = nullptr;    // device array [batch]: each sequence's K base ([hkv][head_stride])
  const void* const* v = nullptr;    // same for V
  const int32_t* lengths = nullptr;  // device [batch]: keys per sequence (>= 1)
  void* out = nullptr;               // [batch, hq, d], same dtype as q
  float* lse = nullptr;        // optional [batch, hq]: ln sum exp(scale q.k) (cascade merges, attention_prefix.cuh)
  DType dtype = DType::kBF16;  // dtype of q, k, v and out (f32 or bf16)
  int64_t head_stride = 0;
  int batch = 0, hq = 0, hkv = 0, d = 0;
  int max_length = 0;  // host-side upper bound of lengths (sizes the grid)
  float scale = 1.0f;
  // Optional (ShadowKV's selection slots): key j of sequence b, KV head h in
  // [slot_row0, slot_row0 + slot_count * slot_rows) is not attended when
  // slot_maps[b][h * slot_count + (j - slot_row0) / slot_rows] < 0 (an empty
  // slot). A (sequence, query head) whose keys are all masked gets out = 0 and
  // lse = -inf.
  const int32_t* const* slot_maps = nullptr;  // device [batch] -> [hkv][slot_count]
  int slot_row0 = 0, slot_count = 0, slot_rows = 0;
  // Optional, with slot_maps (ShadowKV's attached documents with their values
  // in device memory): a slot holding chunk c < slot_values_chunks has its V
  // rows read in place, row i of the chunk at slot_values[b] +
  // ((h * slot_values_stride + c) * slot_rows + i) * d elements (the
  // document's [hkv][stride][slot_rows * d] values, dtype's elements), not
  // from v (where nothing need be copied for it).
  const void* const* slot_values = nullptr;  // device [batch]
  int64_t slot_values_stride = 0;
  int slot_values_chunks = 0;
  void* workspace = nullptr;  // DecodeAttentionWorkspaceBytes() bytes
  size_t workspace_bytes = 0;
};

size_t DecodeAttentionWorkspaceBytes(int batch, int hq, int d, int max_length);
void LaunchDecodeAttention(const DecodeAttentionArgs& args, cudaStream_t stream);

}  // namespace penumbra::kernels
