// Dtype conversion: dst[i] = dst_dtype(src[i]) between f32, bf16 and f16.
// Algorithm: elementwise, through f32 (round-to-nearest-even to 16-bit types).
// Parallelization: grid-stride loop over 4-element packs (16-byte f32 / 8-byte
// 16-bit accesses) when both bases are aligned, a scalar tail; else scalar.
// Memory traffic: reads n source elements, writes n destination elements.
#include "kernels/convert.cuh"

#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/vec.cuh"

namespace penumbra::kernels {
namespace {

constexpr int kThreads = 256;

template <typename S, typename D, int N>
__global__ void __launch_bounds__(kThreads) ConvertKernel(const S* __restrict__ src, D* __restrict__ dst, int64_t n) {
  const int64_t packs = n / N;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t p = first; p < packs; p += stride) {
    const Pack<S, N> in = reinterpret_cast<const Pack<S, N>*>(src)[p];
    Pack<D, N> o;
#pragma unroll
    for (int q = 0; q < N; ++q) o.v[q] = FromF32<D>(ToF32<S>(in.v[q]));
    reinterpret_cast<Pack<D, N>*>(dst)[p] = o;
  }
  for (int64_t i = packs * N + first; i < n; i += stride) dst[i] = FromF32<D>(ToF32<S>(src[i]));
}

template <typename S, typename D>
void Launch(const S* src, D* dst, int64_t n, cudaStream_t stream) {
  constexpr int kVec = 4;
  const bool vec = reinterpret_cast<uintptr_t>(src) % (kVec * sizeof(S)) == 0 &&
                   reinterpret_cast<uintptr_t>(dst) % (kVec * sizeof(D)) == 0;
  const int64_t work = vec ? (n + kVec - 1) / kVec : n;
  const int grid = static_cast<int>(std::min<int64_t>((work + kThreads - 1) / kThreads, 132 * 16));
  if (vec) {
    ConvertKernel<S, D, kVec><<<grid, kThreads, 0, stream>>>(src, dst, n);
  } else {
    ConvertKernel<S, D, 1><<<grid, kThreads, 0, stream>>>(src, dst, n);
  }
}

}  // namespace

void LaunchConvert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  PENUMBRA_DISPATCH_FLOAT(
      src_dtype, S,
      PENUMBRA_DISPATCH_FLOAT(dst_dtype, D, Launch<S, D>(static_cast<const S*>(src), static_cast<D*>(dst), n, stream)));
}

}  // namespace penumbra::kernels
