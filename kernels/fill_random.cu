// Counter-based N(0, std) fill: splitmix64 of (seed, i) gives two uniforms,
// Box-Muller gives one normal per element. Grid-stride loop, one store per
// element; bandwidth bound.
#include "kernels/common.cuh"
#include "kernels/fill_random.cuh"

namespace penumbra::kernels {
namespace {

__device__ __forceinline__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <typename T>
__global__ void FillRandomNormalKernel(T* dst, int64_t n, float std, uint64_t seed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const uint64_t h = SplitMix64(seed * 0x100000001b3ull ^ static_cast<uint64_t>(i));
    const float u1 = (static_cast<float>(h >> 40) + 1.0f) * (1.0f / 16777217.0f);  // (0, 1]
    const float u2 = static_cast<float>((h >> 16) & 0xffffffull) * (1.0f / 16777216.0f);
    const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    dst[i] = FromF32<T>(z * std);
  }
}

}  // namespace

void LaunchFillRandomNormal(void* dst, DType dtype, int64_t n, float std, uint64_t seed, cudaStream_t stream) {
  if (n <= 0) return;
  const int threads = 256;
  const int64_t blocks64 = (n + threads - 1) / threads;
  const int blocks = static_cast<int>(blocks64 < 65536 ? blocks64 : 65536);
  PENUMBRA_DISPATCH_FLOAT(
      dtype, T, FillRandomNormalKernel<T><<<blocks, threads, 0, stream>>>(static_cast<T*>(dst), n, std, seed));
}

}  // namespace penumbra::kernels
