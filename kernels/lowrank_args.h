// Arguments of the low-rank key factorization and the key projection
// (kernels/lowrank.cuh holds the algorithm and the launchers). Plain C++, no
// CUDA headers: the engine's op table (worker/engine/backend.h) carries these,
// CPU-only builds included.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace penumbra::kernels {

struct LowRankArgs {
  const void* keys = nullptr;         // [S, D] device, row-major, contiguous
  DType key_dtype = DType::kF32;      // kF32 or kBF16
  int64_t S = 0;                      // tokens, >= 1 (and < 2^31)
  int hkv = 0, d = 0;                 // D = hkv * d
  int rank = 0;                       // 1 <= rank <= D
  void* a_out = nullptr;              // [S, rank] of factor_dtype
  void* b_out = nullptr;              // [hkv][rank][d] of factor_dtype
  DType factor_dtype = DType::kBF16;  // kBF16 or kF32
  float* proj_out = nullptr;          // [D, rank] f32
  float* sigma_out = nullptr;         // [rank] f32 singular values, descending; may be null
  void* workspace = nullptr;          // LowRankWorkspaceBytes(...) bytes, 256-byte aligned
  size_t workspace_bytes = 0;
};

// A-rows of new tokens: a_out[i] = k[i] * P, [n, D] x [D, rank] -> [n, rank].
// One block per (token, 128 outputs, problem); k row staged in shared memory (D <= 8192).
struct ProjectKeysArgs {
  const void* keys = nullptr;     // [n, D] device
  DType key_dtype = DType::kF32;  // kF32 or kBF16
  int n = 0, D = 0, rank = 0;
  const float* proj = nullptr;     // [D, rank] f32 (LowRankArgs::proj_out)
  void* a_out = nullptr;           // [n, rank] of out_dtype
  int64_t a_row_stride = 0;        // elements between rows of a_out; 0 = rank
  DType out_dtype = DType::kBF16;  // kF32 or kBF16
  // `batch` independent projections in one launch (e.g. every layer of a
  // sequence): problem i reads keys + i*keys_batch_stride and proj +
  // i*proj_batch_stride and writes a_out + i*a_batch_stride (elements).
  int batch = 1;
  int64_t keys_batch_stride = 0, proj_batch_stride = 0, a_batch_stride = 0;
};

}  // namespace penumbra::kernels
