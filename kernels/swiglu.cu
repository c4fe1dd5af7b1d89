// SwiGLU: out[i, j] = silu(g) * u with g = gate_up[i, j], u = gate_up[i, F + j],
// silu(g) = g / (1 + expf(-g)), all in f32 (accurate expf, not __expf).
// Parallelization: grid (column blocks, row groups); each thread produces one
// 4-element pack (16-byte f32 loads) when F and the bases allow it, else one
// element.
// Memory traffic: reads 2*n*F f32, writes n*F of out_dtype.
#include "kernels/swiglu.cuh"

#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/vec.cuh"

namespace penumbra::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    SwiGLUKernel(const float* __restrict__ gate_up, int n, int F, T* __restrict__ out) {
  ChainWait();  // launched chained: see LaunchChained
  ChainRelease();
  const int packs = F / N;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= packs) return;
  for (int i = blockIdx.y; i < n; i += gridDim.y) {
    const float* g_row = gate_up + static_cast<int64_t>(i) * 2 * F;
    const Pack<float, N> g = reinterpret_cast<const Pack<float, N>*>(g_row)[j];
    const Pack<float, N> u = reinterpret_cast<const Pack<float, N>*>(g_row + F)[j];
    Pack<T, N> o;
#pragma unroll
    for (int q = 0; q < N; ++q) o.v[q] = FromF32<T>(__fmul_rn(g.v[q] / (1.0f + expf(-g.v[q])), u.v[q]));
    reinterpret_cast<Pack<T, N>*>(out + static_cast<int64_t>(i) * F)[j] = o;
  }
}

template <typename T>
void Launch(const float* gate_up, int n, int F, T* out, cudaStream_t stream) {
  constexpr int kVec = 4;
  const bool vec = F % kVec == 0 && reinterpret_cast<uintptr_t>(gate_up) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % (kVec * sizeof(T)) == 0;
  const int packs = vec ? F / kVec : F;
  const dim3 grid((packs + kThreads - 1) / kThreads, std::min(n, 65535));
  if (vec) {
    LaunchChained(SwiGLUKernel<T, kVec>, grid, kThreads, 0, stream, gate_up, n, F, out);
  } else {
    LaunchChained(SwiGLUKernel<T, 1>, grid, kThreads, 0, stream, gate_up, n, F, out);
  }
}

}  // namespace

void LaunchSwiGLU(const float* gate_up, int n, int F, void* out, DType out_dtype, cudaStream_t stream) {
  if (n <= 0 || F <= 0) return;
  PENUMBRA_DISPATCH_FLOAT(out_dtype, T, Launch<T>(gate_up, n, F, static_cast<T*>(out), stream));
}

}  // namespace penumbra::kernels
