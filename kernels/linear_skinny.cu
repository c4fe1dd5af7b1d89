// Skinny linear layer: y[n, out] (+)= x[n, in] . W[out, in]^T for n <= 16.
//
// Decode multiplies a handful of activation rows by every weight matrix, so
// the work is reading W once at full HBM bandwidth; cuBLAS reaches ~2.9 TB/s
// on these shapes (docs/benchmarks.md). Here W is streamed straight from
// global memory into tensor-core fragments, with no shared-memory staging:
//
// - Tensor cores: mma.sync m16n8k16 with 16 rows of W as the A operand and
//   the batch as the N dimension (n8 tiles; NT = 1 for n <= 8, 2 for <= 16).
// - Permuted k: a dot product does not care about the order of its terms, so
//   lane (g = lane/4, c = lane%4) loads 16 contiguous bytes at k = 32s + 8c
//   of W rows g and g + 8 and of x row g, and uses them as the fragments of
//   two k-steps (words 0,1 then 2,3). Every fragment is one 16-byte load.
// - W loads bypass L1 (ld.global.nc.L1::no_allocate) and ask L2 for 256-byte
//   sectors (a row's 4 lanes read 64 contiguous bytes per step; kUnroll
//   steps make a 256-byte run); x loads go through L1, where the warps of a
//   block that share a k range reuse them.
// - Parallelization: a block is 8 warps = RT row tiles (16 rows each) x KS
//   k-splits (RT * KS = 8). RT is the largest of 8, 4, 2, 1 that still gives
//   two blocks per SM, so short outputs split k and long ones do not. The
//   KS partial tiles meet in shared memory and are summed in a fixed order,
//   so the result is deterministic.
//
// Memory traffic: reads W once (out * in * 2 bytes) plus x from L1/L2;
// writes (and with accumulate reads) y.
#include "kernels/linear_skinny.cuh"

#include <cstdint>

#include <cuda_bf16.h>

#include "kernels/common.cuh"
#include "kernels/cuda_check.h"
#include "kernels/mma.cuh"

namespace penumbra::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 16;  // W rows per warp tile (the MMA's M)
constexpr int kStep = 32;  // k per warp step: 4 lanes x 8 elements

__device__ __forceinline__ uint4 LoadStreaming(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

__device__ __forceinline__ void PrefetchL2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <int NT, int kUnroll>
__global__ void __launch_bounds__(kThreads, 2)
    SkinnyLinearKernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, int n, int out,
                       int in, float* __restrict__ y, bool accumulate, int rt_per_block) {
  __shared__ float partial[kWarps][kTile][NT * 8];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, c = lane & 3;
  const int RT = rt_per_block, KS = kWarps / RT;
  const int rt = warp % RT, ks = warp / RT;
  const int row0 = (blockIdx.x * RT + rt) * kTile;
  const int steps = (in + kStep - 1) / kStep;
  const int s0 = static_cast<int>(static_cast<int64_t>(steps) * ks / KS);
  const int s1 = static_cast<int>(static_cast<int64_t>(steps) * (ks + 1) / KS);

  const bool lo_ok = row0 + g < out, hi_ok = row0 + g + 8 < out;
  const __nv_bfloat16* w_lo = w + static_cast<int64_t>(lo_ok ? row0 + g : 0) * in + 8 * c;
  const __nv_bfloat16* w_hi = w + static_cast<int64_t>(hi_ok ? row0 + g + 8 : 0) * in + 8 * c;
  // W does not depend on the kernels before this one: the warp's first
  // kUnroll steps of it are on their way to L2 while a chained launch waits.
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int k = (s0 + u) * kStep;
    if (s0 + u < s1 && k + 8 * c < in) {
      if (lo_ok) PrefetchL2(w_lo + k);
      if (hi_ok) PrefetchL2(w_hi + k);
    }
  }
  ChainWait();  // launched chained: see LaunchChained
  ChainRelease();
  const __nv_bfloat16* x_row[NT];
  bool x_ok[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int b = g + 8 * t;
    x_ok[t] = b < n;
    x_row[t] = x + static_cast<int64_t>(x_ok[t] ? b : 0) * in + 8 * c;
  }

  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;

  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int s = s0; s < s1; s += kUnroll) {
    uint4 a_lo[kUnroll], a_hi[kUnroll], xb[kUnroll][NT];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = (s + u) * kStep;  // + 8c is in the row pointers
      const bool k_ok = s + u < s1 && k + 8 * c < in;
      a_lo[u] = k_ok && lo_ok ? LoadStreaming(w_lo + k) : zero;
      a_hi[u] = k_ok && hi_ok ? LoadStreaming(w_hi + k) : zero;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        xb[u][t] = k_ok && x_ok[t] ? __ldg(reinterpret_cast<const uint4*>(x_row[t] + k)) : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          MmaBf16(acc[t], Word(a_lo[u], 2 * h), Word(a_hi[u], 2 * h), Word(a_lo[u], 2 * h + 1),
                  Word(a_hi[u], 2 * h + 1), Word(xb[u][t], 2 * h), Word(xb[u][t], 2 * h + 1));
        }
      }
    }
  }

  // C fragment: acc[t][0..1] = rows g, batch 8t + 2c + {0,1}; [2..3] = row g + 8.
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    partial[warp][g][8 * t + 2 * c] = acc[t][0];
    partial[warp][g][8 * t + 2 * c + 1] = acc[t][1];
    partial[warp][g + 8][8 * t + 2 * c] = acc[t][2];
    partial[warp][g + 8][8 * t + 2 * c + 1] = acc[t][3];
  }
  __syncthreads();
  const int rows = RT * kTile;
  for (int i = threadIdx.x; i < rows * n; i += kThreads) {
    const int b = i / rows, rr = i % rows;
    const int t = rr / kTile, r = rr % kTile;
    const int row = blockIdx.x * rows + rr;
    if (row >= out) continue;
    float sum = 0.0f;
    for (int k = 0; k < KS; ++k) sum += partial[k * RT + t][r][b];
    float* dst = y + static_cast<int64_t>(b) * out + row;
    *dst = accumulate ? *dst + sum : sum;
  }
}

int MultiProcessorCount() {
  static thread_local int cached_dev = -1, cached_sms = 0;
  int dev = 0;
  PENUMBRA_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev != cached_dev) {
    PENUMBRA_CUDA_CHECK(cudaDeviceGetAttribute(&cached_sms, cudaDevAttrMultiProcessorCount, dev));
    cached_dev = dev;
  }
  return cached_sms;
}

}  // namespace

bool SkinnyLinearSupported(const SkinnyLinearArgs& a, DType dtype) {
  return dtype == DType::kBF16 && a.n >= 1 && a.n <= kSkinnyLinearMaxRows && a.out >= 1 && a.in >= 8 &&
         a.in % 8 == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && reinterpret_cast<uintptr_t>(a.w) % 16 == 0 &&
         a.y != nullptr;
}

void LaunchSkinnyLinear(const SkinnyLinearArgs& a, cudaStream_t stream) {
  const int tiles = (a.out + kTile - 1) / kTile;
  const int want_blocks = 2 * MultiProcessorCount();
  int rt = kWarps;
  while (rt > 1 && (tiles + rt - 1) / rt < want_blocks) rt /= 2;
  const int blocks = (tiles + rt - 1) / rt;
  const auto* x = static_cast<const __nv_bfloat16*>(a.x);
  const auto* w = static_cast<const __nv_bfloat16*>(a.w);
  if (a.n <= 8) {
    LaunchChained(SkinnyLinearKernel<1, 8>, blocks, kThreads, 0, stream, x, w, a.n, a.out, a.in, a.y, a.accumulate, rt);
  } else {
    LaunchChained(SkinnyLinearKernel<2, 4>, blocks, kThreads, 0, stream, x, w, a.n, a.out, a.in, a.y, a.accumulate, rt);
  }
}

}  // namespace penumbra::kernels
