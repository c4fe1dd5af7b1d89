// RMSNorm (Llama): out = (x * r) * w with r = 1 / sqrtf(mean(x^2) + eps), f32.
// Algorithm: per row, a block-wide f32 sum of squares (per-thread partials, warp
// shuffles, then across warps), then a second sweep that scales and converts.
// Parallelization: one block per row (grid-stride over rows); threads stride
// the row in 4-element packs (16-byte f32 loads) when dim and the bases allow.
// Memory traffic: x is read twice (the second read hits L1/L2 for Llama-sized
// rows), w once per row (cached), out written once: ~n*dim*(4 + sizeof(out)).
#include "kernels/rmsnorm.cuh"

#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/vec.cuh"

namespace penumbra::kernels {
namespace {

constexpr int kThreads = 256;

template <typename TW, typename TO, int N>
__global__ void __launch_bounds__(kThreads) RmsNormKernel(const float* __restrict__ x, const TW* __restrict__ w, int n,
                                                          int dim, float eps, TO* __restrict__ out) {
  ChainWait();  // launched chained: see LaunchChained
  ChainRelease();
  __shared__ float warp_sums[kThreads / 32];
  __shared__ float row_scale;
  const int packs = dim / N;
  for (int i = blockIdx.x; i < n; i += gridDim.x) {
    const auto* xr = reinterpret_cast<const Pack<float, N>*>(x + static_cast<int64_t>(i) * dim);
    float ss = 0.0f;
    for (int j = threadIdx.x; j < packs; j += blockDim.x) {
      const Pack<float, N> v = xr[j];
#pragma unroll
      for (int q = 0; q < N; ++q) ss += v.v[q] * v.v[q];
    }
    ss = WarpSum(ss);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
      float s = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.0f;
      s = WarpSum(s);
      if (threadIdx.x == 0) row_scale = 1.0f / sqrtf(s / static_cast<float>(dim) + eps);
    }
    __syncthreads();
    const float r = row_scale;
    auto* o = reinterpret_cast<Pack<TO, N>*>(out + static_cast<int64_t>(i) * dim);
    const auto* wp = reinterpret_cast<const Pack<TW, N>*>(w);
    for (int j = threadIdx.x; j < packs; j += blockDim.x) {
      const Pack<float, N> v = xr[j];
      const Pack<TW, N> wv = wp[j];
      Pack<TO, N> res;
#pragma unroll
      for (int q = 0; q < N; ++q) res.v[q] = FromF32<TO>(__fmul_rn(__fmul_rn(v.v[q], r), ToF32<TW>(wv.v[q])));
      o[j] = res;
    }
    __syncthreads();  // warp_sums / row_scale are reused by the next row
  }
}

template <typename TW, typename TO>
void Launch(const float* x, const TW* w, int n, int dim, float eps, TO* out, cudaStream_t stream) {
  constexpr int kVec = 4;
  const bool vec = dim % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(w) % (kVec * sizeof(TW)) == 0 &&
                   reinterpret_cast<uintptr_t>(out) % (kVec * sizeof(TO)) == 0;
  const int grid = std::min(n, 65535);
  if (vec) {
    LaunchChained(RmsNormKernel<TW, TO, kVec>, grid, kThreads, 0, stream, x, w, n, dim, eps, out);
  } else {
    LaunchChained(RmsNormKernel<TW, TO, 1>, grid, kThreads, 0, stream, x, w, n, dim, eps, out);
  }
}

}  // namespace

void LaunchRmsNorm(const float* x, const void* w, DType w_dtype, int n, int dim, float eps, void* out, DType out_dtype,
                   cudaStream_t stream) {
  if (n <= 0 || dim <= 0) return;
  PENUMBRA_DISPATCH_FLOAT(
      w_dtype, TW,
      PENUMBRA_DISPATCH_FLOAT(
          out_dtype, TO, Launch<TW, TO>(x, static_cast<const TW*>(w), n, dim, eps, static_cast<TO*>(out), stream)));
}

}  // namespace penumbra::kernels
