// Embedding lookup: out[i, :] = f32(table[ids[i], :]).
// Algorithm: a gather; each block copies whole rows, converting to f32.
// Parallelization: grid (min(n, 65535) row groups); blockDim threads stride a
// row in 16-byte packs (4 f32 or 8 bf16/f16 per load) when dim and both bases
// allow it, else element by element.
// Memory traffic: reads n*dim table elements, writes n*dim f32 (bandwidth bound).
#include "kernels/embedding.cuh"

#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/vec.cuh"

namespace penumbra::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    EmbeddingKernel(const T* __restrict__ table, const int32_t* __restrict__ ids, int n, int dim,
                    float* __restrict__ out) {
  const int packs = dim / N;
  for (int i = blockIdx.x; i < n; i += gridDim.x) {
    const auto* src = reinterpret_cast<const Pack<T, N>*>(table + static_cast<int64_t>(ids[i]) * dim);
    auto* dst = reinterpret_cast<Pack<float, N>*>(out + static_cast<int64_t>(i) * dim);
    for (int j = threadIdx.x; j < packs; j += blockDim.x) {
      const Pack<T, N> in = src[j];
      Pack<float, N> o;
#pragma unroll
      for (int q = 0; q < N; ++q) o.v[q] = ToF32<T>(in.v[q]);
      dst[j] = o;
    }
  }
}

template <typename T>
void Launch(const T* table, const int32_t* ids, int n, int dim, float* out, cudaStream_t stream) {
  constexpr int kVec = static_cast<int>(kMaxVecBytes / sizeof(T));
  const bool vec =
      dim % kVec == 0 && reinterpret_cast<uintptr_t>(table) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int grid = std::min(n, 65535);
  if (vec) {
    EmbeddingKernel<T, kVec><<<grid, kThreads, 0, stream>>>(table, ids, n, dim, out);
  } else {
    EmbeddingKernel<T, 1><<<grid, kThreads, 0, stream>>>(table, ids, n, dim, out);
  }
}

}  // namespace

void LaunchEmbedding(const void* table, DType table_dtype, const int32_t* ids, int n, int dim, float* out,
                     cudaStream_t stream) {
  if (n <= 0 || dim <= 0) return;
  PENUMBRA_DISPATCH_FLOAT(table_dtype, T, Launch<T>(static_cast<const T*>(table), ids, n, dim, out, stream));
}

}  // namespace penumbra::kernels
