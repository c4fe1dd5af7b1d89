// Exact log-sum-exp merge of partial attentions (kernels/attention_merge.cuh).
#include "kernels/attention_merge.cuh"

#include <cmath>
#include <cstdint>

#include "kernels/common.cuh"

namespace penumbra::kernels {
namespace {

constexpr int kWarps = 8;  // rows per block

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    MergeKernel(const T* x, int64_t xs, const float* __restrict__ lse, int64_t ls, int parts, int rows, int d, T* out,
                float* lse_out) {
  const int row = blockIdx.x * kWarps + static_cast<int>(threadIdx.x / 32);
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float m = -INFINITY;
  for (int p = 0; p < parts; ++p) m = fmaxf(m, lse[p * ls + row]);
  // Every part empty: the row saw no key at all (out of contract); zeros.
  const bool none = m == -INFINITY;
  float total = 0.0f;
  for (int p = 0; p < parts; ++p) {
    const float l = lse[p * ls + row];
    total += none ? 0.0f : __expf(l - m);
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  // Reads of every part for an element happen before its write: out may
  // alias part 0 (each element is read and written by the same lane).
  for (int j = lane; j < d; j += 32) {
    float acc = 0.0f;
    for (int p = 0; p < parts; ++p) {
      const float l = lse[p * ls + row];
      const float w = none ? 0.0f : __expf(l - m) * inv;
      acc += w * ToF32<T>(x[p * xs + static_cast<int64_t>(row) * d + j]);
    }
    out[static_cast<int64_t>(row) * d + j] = FromF32<T>(acc);
  }
  if (lse_out != nullptr && lane == 0) lse_out[row] = none ? -INFINITY : m + __logf(total);
}

}  // namespace

void LaunchMergeAttention(const MergeAttentionArgs& a, cudaStream_t stream) {
  if (a.rows <= 0 || a.parts <= 0) return;
  const dim3 grid((a.rows + kWarps - 1) / kWarps);
  PENUMBRA_DISPATCH_FLOAT(a.dtype, T,
                          MergeKernel<T><<<grid, kWarps * 32, 0, stream>>>(static_cast<const T*>(a.x), a.x_part_stride,
                                                                           a.lse, a.lse_part_stride, a.parts, a.rows,
                                                                           a.d, static_cast<T*>(a.out), a.lse_out));
}

}  // namespace penumbra::kernels
