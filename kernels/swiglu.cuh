// SwiGLU: out[i, j] = silu(gu[i, j]) * gu[i, F + j], math in f32.
// Elementwise; reads 2*n*F f32, writes n*F of out_dtype.
#pragma once
#include <cuda_runtime_api.h>
#include "common/dtype.h"

namespace penumbra::kernels {
// gate_up: [n, 2F] f32 (gate columns first, then up); out: [n, F] of out_dtype.
void LaunchSwiGLU(const float* gate_up, int n, int F, void* out, DType out_dtype, cudaStream_t stream);
}  // namespace penumbra::kernels
