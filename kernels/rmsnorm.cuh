// RMSNorm (Llama): out = (x * rsqrt(mean(x^2) + eps)) * w, math in f32.
// One block per row; one read of x and w, one write of out.
#pragma once
#include <cuda_runtime_api.h>
#include "common/dtype.h"

namespace penumbra::kernels {
// x: [n, dim] f32; w: [dim] of w_dtype; out: [n, dim] of out_dtype (f32/bf16/f16).
void LaunchRmsNorm(const float* x, const void* w, DType w_dtype, int n, int dim, float eps, void* out, DType out_dtype,
                   cudaStream_t stream);
}  // namespace penumbra::kernels
