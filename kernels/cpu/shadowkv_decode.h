// CPU references of the ShadowKV decode kernels (kernels/shadowkv_decode.cuh)
// and of row-wise top-k (kernels/topk.cuh): f32 tensors, host pointers, same
// layouts and semantics. Sums over chunks accumulate in double.
#pragma once

#include <cstdint>

namespace penumbra::kernels::cpu {

// As kernels::TopKArgs (counts is a host array).
struct TopKArgs {
  const float* values = nullptr;
  int64_t stride = 0;
  int rows = 0;
  const int32_t* counts = nullptr;
  int rows_per_count = 1;
  int uniform_count = 0;
  int k = 0;
  bool smallest = false;
  bool skip_worst_inf = false;
  int32_t* out = nullptr;
  int64_t out_stride = 0;
};
void TopK(const TopKArgs& a);

// The 32-bit key whose unsigned order is top-k's order (larger = preferred);
// NaN (and with skip_worst_inf the worst infinity) maps to 0, which ranks
// last and, with skip_worst_inf, is never selected. The CUDA kernel uses the
// same mapping.
uint32_t TopKKey(float v, bool smallest, bool skip_worst_inf = false);

// As kernels::ShadowkvScoreArgs, f32, host arrays.
struct ShadowkvScoreArgs {
  const float* q = nullptr;                  // [batch, hq, d]
  const float* const* landmarks = nullptr;   // [batch] -> [hkv][chunk_cap][d]
  const uint8_t* const* excluded = nullptr;  // [batch] -> [hkv][chunk_cap]; may be null
  const int32_t* n_chunks = nullptr;         // [batch]
  int batch = 0, hq = 0, hkv = 0, d = 0;
  int chunk_cap = 0, max_chunks = 0;
  // An attached prefix's landmarks for chunks below shared_chunks (see the
  // CUDA header); landmark_cap: own rows per head (0: chunk_cap).
  const float* const* shared_landmarks = nullptr;
  int shared_chunks = 0, landmark_cap = 0;
  // Set instead of landmarks / shared_landmarks: fp8 chunk records
  // (kernels/landmark_format.h), the same records per head.
  const uint8_t* const* landmarks_fp8 = nullptr;
  const uint8_t* const* shared_landmarks_fp8 = nullptr;
  float scale = 1.0f;
  int successors = 0;           // see the CUDA header
  int landmarks_per_chunk = 1;  // see the CUDA header
  float* scores = nullptr;      // [batch, hkv, score_stride]
  int64_t score_stride = 0;
  // Context parallel (see the CUDA header): stats_out: write each head's
  // (max, sum exp) and nothing else; stats_in: normalize with the combination
  // of stats_parts parts (logits recomputed here).
  float* stats_out = nullptr;
  const float* stats_in = nullptr;
  int stats_parts = 0;
  int64_t stats_part_stride = 0;
};
void ShadowkvScore(const ShadowkvScoreArgs& a);
// A selection's scores: out[row * stride + i] = scores[row][selection[row *
// stride + i]] for i < k, -inf where the selection is -1 and for k <= i < stride.
void SelectionScores(const float* scores, int64_t score_stride, const int32_t* selection, int64_t stride, int rows,
                     int k, float* out);

// As kernels::ShadowkvGlobalSelectArgs, host arrays.
struct ShadowkvGlobalSelectArgs {
  const float* candidates = nullptr;
  int parts = 0, rank = 0;
  int64_t part_stride = 0;
  int rows = 0, cand_stride = 0, k = 0;
  const int32_t* proposals = nullptr;
  int32_t* winners = nullptr;
  int32_t* selection = nullptr;
  int64_t selection_stride = 0;
  int selection_len = 0;
};
void ShadowkvGlobalSelect(const ShadowkvGlobalSelectArgs& a);
// out[c] = max(out[c] when accumulate, in[r * row_stride + c] over r < rows), c < cols.
void MaxRows(const float* in, int rows, int64_t row_stride, int64_t cols, float* out, bool accumulate);

// As kernels::ShadowkvSlotUpdateArgs, host arrays.
struct ShadowkvSlotUpdateArgs {
  const int32_t* selection = nullptr;
  int64_t selection_stride = 0;
  int32_t* const* slot_maps = nullptr;
  int32_t* miss_count = nullptr;
  int32_t* miss_slot = nullptr;
  int32_t* miss_chunk = nullptr;
  int batch = 0, hkv = 0, kslots = 0, chunk_cap = 0;
  float force_keep = -1.0f;
};
void ShadowkvSlotUpdate(const ShadowkvSlotUpdateArgs& a);

// As kernels::ShadowkvRebuildKArgs, f32, host arrays.
struct ShadowkvRebuildKArgs {
  const float* const* a = nullptr;
  const float* const* shared_a = nullptr;  // an attached prefix's A rows (see the CUDA header)
  int shared_chunks = 0;
  const float* const* b = nullptr;
  const int32_t* position_offset = nullptr;  // may be null
  const float* inv_freq = nullptr;
  const int32_t* miss_count = nullptr;
  const int32_t* miss_slot = nullptr;
  const int32_t* miss_chunk = nullptr;
  int miss_stride = 0;
  float* const* att_k = nullptr;
  int64_t att_head_stride = 0;
  int outlier_rows = 0;
  int batch = 0, hkv = 0, d = 0, r = 0, chunk_size = 0;
};
void ShadowkvRebuildK(const ShadowkvRebuildKArgs& a);

// As kernels::ShadowkvFetchVArgs, f32, host arrays (staging null: FetchV).
// values_fp8: the store's and staging's rows are fp8 (kernels/value_format.h;
// the pointers then point at those bytes), dequantized into V.
struct ShadowkvFetchVArgs {
  const float* const* value_store = nullptr;
  int chunk_cap = 0;
  const float* const* shared_store = nullptr;  // chunks below shared_chunks (see the CUDA header)
  int shared_chunks = 0;
  int shared_stride = 0;
  bool values_fp8 = false;
  const float* staging = nullptr;
  const int32_t* staging_offsets = nullptr;
  const int32_t* miss_count = nullptr;
  const int32_t* miss_slot = nullptr;
  const int32_t* miss_chunk = nullptr;
  int miss_stride = 0;
  float* const* att_v = nullptr;
  int64_t att_head_stride = 0;
  int outlier_rows = 0;
  int batch = 0, hkv = 0, d = 0, chunk_size = 0;
  bool skip_shared = false;  // chunks below shared_chunks not copied (see the CUDA header)
};
void ShadowkvFetchV(const ShadowkvFetchVArgs& a);

}  // namespace penumbra::kernels::cpu
