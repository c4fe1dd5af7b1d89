// Dtype conversion: dst[i] = dst_dtype(src[i]). Elementwise.
#pragma once
#include <cuda_runtime_api.h>
#include <cstdint>
#include "common/dtype.h"

namespace penumbra::kernels {
void LaunchConvert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, cudaStream_t stream);
}  // namespace penumbra::kernels
