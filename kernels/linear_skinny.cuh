// Linear layer for few rows (decode batches): y[n, out] = (y +) x[n, in] . W[out, in]^T
// with bf16 x and W and f32 y. Memory-bound on W; replaces cuBLAS where it
// takes the problem (see SkinnyLinearSupported). Optionally fused with the
// SwiGLU after it (gate and up rows of one W), giving the unfused bits.
#pragma once

#include <cuda_runtime_api.h>

#include "common/dtype.h"

namespace penumbra::kernels {

// Largest row count (batch) the skinny kernel takes.
constexpr int kSkinnyLinearMaxRows = 16;

struct SkinnyLinearArgs {
  const void* x = nullptr;  // [n, in] bf16, row-major
  const void* w = nullptr;  // [out, in] bf16, row-major ([2 * out, in] with act_out)
  int n = 0, out = 0, in = 0;
  float* y = nullptr;       // [n, out] f32, row-major (unused with act_out)
  bool accumulate = false;  // y += x . W^T instead of y = x . W^T

  // SwiGLU epilogue (with act_out): W holds the gate rows [0, out) then the up
  // rows [out, 2 out); act_out = silu(gate) * up in bf16, the bits
  // LaunchSwiGLU writes from the f32 products. y is not written.
  void* act_out = nullptr;  // [n, out] bf16
};

// True when LaunchSkinnyLinear takes the problem: bf16, 1 <= n <= 16,
// in % 8 == 0, x and w 16-byte aligned, out >= 1; y set, or act_out set
// without accumulate.
bool SkinnyLinearSupported(const SkinnyLinearArgs& a, DType dtype);

// Requires SkinnyLinearSupported(a, kBF16). Deterministic (fixed reduction order);
// with act_out, the same bits as the unfused linear and SwiGLU.
void LaunchSkinnyLinear(const SkinnyLinearArgs& a, cudaStream_t stream);

}  // namespace penumbra::kernels
