// Values stored in fp8 (kernels/value_format.h): the CUDA encoder (a value
// row's C tokens of d elements -> codes and per-token scales) and decoder,
// bit-exact with the format's reference codec. The dequantizing value fetch
// of ShadowKV decode is ShadowkvFetchVArgs::values_fp8 (shadowkv_fetch_v.cu).
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "common/dtype.h"

namespace penumbra::kernels {

// An e4m3 code's value, exact (through half, which holds every e4m3 value);
// 0x7f and 0xff are NaN.
__device__ __forceinline__ float E4M3Value(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

// rows value rows of chunk_tokens x d elements of `dtype` (f32 or bf16,
// contiguous) -> rows fp8 rows of ValueRowBytesFp8(chunk_tokens, d) bytes.
// Supported: d % 16 == 0, d <= 256.
void LaunchEncodeValuesFp8(const void* src, DType dtype, int64_t rows, int chunk_tokens, int d, uint8_t* dst,
                           cudaStream_t stream);
// The inverse: fp8 rows -> rows of `dtype` (f32 or bf16).
void LaunchDecodeValuesFp8(const uint8_t* src, int64_t rows, int chunk_tokens, int d, void* dst, DType dtype,
                           cudaStream_t stream);

}  // namespace penumbra::kernels
