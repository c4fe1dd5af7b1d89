// Values stored in fp8: encoder and decoder (contracts in value_fp8.cuh, the
// format in value_format.h).
#include "kernels/value_fp8.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <glog/logging.h>

#include "kernels/common.cuh"
#include "kernels/cuda_check.h"
#include "kernels/value_format.h"

namespace penumbra::kernels {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kMaxPerLane = 8;  // d <= 256

// One warp per token: its scale from the finite values' largest |x| (the
// division rounded as the host's), then each code.
template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    EncodeValuesFp8Kernel(const T* __restrict__ src, int64_t tokens, int chunk_tokens, int d, int64_t row_bytes,
                          uint8_t* __restrict__ dst) {
  const int lane = threadIdx.x & 31;
  const int64_t tok = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (tok >= tokens) return;
  const int64_t row = tok / chunk_tokens;
  const int t = static_cast<int>(tok - row * chunk_tokens);
  const T* x = src + tok * d;
  float v[kMaxPerLane];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int j = lane + 32 * i;
    v[i] = j < d ? ToF32(x[j]) : 0.0f;
    if (j < d && isfinite(v[i])) amax = fmaxf(amax, fabsf(v[i]));
  }
  amax = WarpMax(amax);
  const float inv = amax > 0.0f ? __fdiv_rn(kE4M3Max, amax) : 1.0f;
  const float scale = amax > 0.0f ? __fdiv_rn(amax, kE4M3Max) : 1.0f;
  uint8_t* out = dst + row * row_bytes;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int j = lane + 32 * i;
    if (j < d) {
      out[static_cast<int64_t>(t) * d + j] =
          isfinite(v[i]) ? static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(v[i], inv), __NV_SATFINITE, __NV_E4M3))
                         : kE4M3NaN;
    }
  }
  if (lane == 0) {
    reinterpret_cast<float*>(out + static_cast<int64_t>(chunk_tokens) * d)[t] = scale;
    if (t == chunk_tokens - 1) {  // the row's padding
      const int64_t used = static_cast<int64_t>(chunk_tokens) * d + 4 * static_cast<int64_t>(chunk_tokens);
      for (int64_t b = used; b < row_bytes; ++b) out[b] = 0;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(256)
    DecodeValuesFp8Kernel(const uint8_t* __restrict__ src, int64_t elems, int chunk_tokens, int d, int64_t row_bytes,
                          T* __restrict__ dst) {
  const int64_t per_row = static_cast<int64_t>(chunk_tokens) * d;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row, k = i - row * per_row;
    const uint8_t* in = src + row * row_bytes;
    const float scale = reinterpret_cast<const float*>(in + per_row)[k / d];
    dst[i] = FromF32<T>(__fmul_rn(E4M3Value(in[k]), scale));
  }
}

}  // namespace

void LaunchEncodeValuesFp8(const void* src, DType dtype, int64_t rows, int chunk_tokens, int d, uint8_t* dst,
                           cudaStream_t stream) {
  CHECK(d % 16 == 0 && d <= 32 * kMaxPerLane) << "EncodeValuesFp8: d " << d;
  const int64_t tokens = rows * chunk_tokens;
  if (tokens <= 0) return;
  const int64_t row_bytes = ValueRowBytesFp8(chunk_tokens, d);
  const auto blocks = static_cast<unsigned>((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (dtype == DType::kBF16) {
    EncodeValuesFp8Kernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(static_cast<const __nv_bfloat16*>(src), tokens,
                                                                      chunk_tokens, d, row_bytes, dst);
  } else {
    CHECK(dtype == DType::kF32) << "EncodeValuesFp8: dtype";
    EncodeValuesFp8Kernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(static_cast<const float*>(src), tokens,
                                                                      chunk_tokens, d, row_bytes, dst);
  }
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

void LaunchDecodeValuesFp8(const uint8_t* src, int64_t rows, int chunk_tokens, int d, void* dst, DType dtype,
                           cudaStream_t stream) {
  const int64_t elems = rows * chunk_tokens * d;
  if (elems <= 0) return;
  const int64_t row_bytes = ValueRowBytesFp8(chunk_tokens, d);
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((elems + 255) / 256, 65535));
  if (dtype == DType::kBF16) {
    DecodeValuesFp8Kernel<<<blocks, 256, 0, stream>>>(src, elems, chunk_tokens, d, row_bytes,
                                                      static_cast<__nv_bfloat16*>(dst));
  } else {
    CHECK(dtype == DType::kF32) << "DecodeValuesFp8: dtype";
    DecodeValuesFp8Kernel<<<blocks, 256, 0, stream>>>(src, elems, chunk_tokens, d, row_bytes, static_cast<float*>(dst));
  }
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace penumbra::kernels
