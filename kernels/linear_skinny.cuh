// Linear layer for few rows (decode batches): y[n, out] = (y +) x[n, in] . W[out, in]^T
// with bf16 x and W and f32 y. Memory-bound on W; replaces cuBLAS where it
// takes the problem (see SkinnyLinearSupported).
#pragma once

#include <cuda_runtime_api.h>

#include "common/dtype.h"

namespace penumbra::kernels {

// Largest row count (batch) the skinny kernel takes.
constexpr int kSkinnyLinearMaxRows = 16;

struct SkinnyLinearArgs {
  const void* x = nullptr;  // [n, in] bf16, row-major
  const void* w = nullptr;  // [out, in] bf16, row-major
  int n = 0, out = 0, in = 0;
  float* y = nullptr;       // [n, out] f32, row-major
  bool accumulate = false;  // y += x . W^T instead of y = x . W^T
};

// True when LaunchSkinnyLinear takes the problem: bf16, 1 <= n <= 16,
// in % 8 == 0, x and w 16-byte aligned, out >= 1.
bool SkinnyLinearSupported(const SkinnyLinearArgs& a, DType dtype);

// Requires SkinnyLinearSupported(a, kBF16). Deterministic (fixed reduction order).
void LaunchSkinnyLinear(const SkinnyLinearArgs& a, cudaStream_t stream);

}  // namespace penumbra::kernels
