// Bias add: x[i, j] += bias[j], in place on f32 activations.
// Parallelization: grid (column blocks, row groups); each thread updates one
// 4-element pack (16-byte f32 access) when dim and both bases allow it, else
// one element.
// Memory traffic: reads and writes n*dim f32; the bias row stays in cache.
#include "kernels/add_bias.cuh"

#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/vec.cuh"

namespace penumbra::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    AddBiasKernel(float* __restrict__ x, const T* __restrict__ bias, int n, int dim) {
  const int packs = dim / N;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= packs) return;
  const Pack<T, N> b = reinterpret_cast<const Pack<T, N>*>(bias)[j];
  for (int i = blockIdx.y; i < n; i += gridDim.y) {
    auto* row = reinterpret_cast<Pack<float, N>*>(x + static_cast<int64_t>(i) * dim);
    Pack<float, N> v = row[j];
#pragma unroll
    for (int q = 0; q < N; ++q) v.v[q] += ToF32<T>(b.v[q]);
    row[j] = v;
  }
}

template <typename T>
void Launch(float* x, const T* bias, int n, int dim, cudaStream_t stream) {
  constexpr int kVec = 4;
  const bool vec = dim % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(bias) % (kVec * sizeof(T)) == 0;
  const int packs = vec ? dim / kVec : dim;
  const dim3 grid((packs + kThreads - 1) / kThreads, std::min(n, 65535));
  if (vec) {
    AddBiasKernel<T, kVec><<<grid, kThreads, 0, stream>>>(x, bias, n, dim);
  } else {
    AddBiasKernel<T, 1><<<grid, kThreads, 0, stream>>>(x, bias, n, dim);
  }
}

}  // namespace

void LaunchAddBias(float* x, const void* bias, DType bias_dtype, int n, int dim, cudaStream_t stream) {
  if (n <= 0 || dim <= 0) return;
  PENUMBRA_DISPATCH_FLOAT(bias_dtype, T, Launch<T>(x, static_cast<const T*>(bias), n, dim, stream));
}

}  // namespace penumbra::kernels
