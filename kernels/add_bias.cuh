// Bias add: x[i, j] += bias[j] (Qwen2's QKV bias). Elementwise.
#pragma once
#include <cuda_runtime_api.h>
#include "common/dtype.h"

namespace penumbra::kernels {
void LaunchAddBias(float* x, const void* bias, DType bias_dtype, int n, int dim, cudaStream_t stream);
}  // namespace penumbra::kernels
