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
// Fusions (a decode layer is a chain of dependent kernels, and each kernel of
// the chain costs a wait besides its work):
// - SwiGLU epilogue: a warp tile pairs 8 gate rows (MMA rows 0-7) with the up
//   rows of the same 8 features (rows 8-15), so a feature's two products
//   meet in one partial tile and leave as silu(gate) * up. The tile count,
//   hence the k split and every product's bits, equals the unfused kernel's
//   on the same [2 out, in] W.
// (An RMSNorm epilogue, where the last block to finish normalized the output
// rows, and an RMSNorm prologue, where every block normalized its input rows,
// both measured slower than the separate RMSNorm kernel:
// bench/results/2026-11-21-h200-swiglu.jsonl.)
//
// Memory traffic: reads W once (out * in * 2 bytes) plus x from L1/L2; writes
// (and with accumulate reads) y, or writes act_out.
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

// kSwiGLU: tile rows 0-7 are gate rows, 8-15 the same features' up rows;
// act_out receives silu(gate) * up.
template <int NT, int kUnroll, bool kSwiGLU>
__global__ void __launch_bounds__(kThreads, 2) SkinnyLinearKernel(SkinnyLinearArgs a, int rt_per_block) {
  constexpr int kOutsPerTile = kSwiGLU ? kTile / 2 : kTile;
  __shared__ float partial[kWarps][kTile][NT * 8];
  const int n = a.n, out = a.out, in = a.in;
  const auto* __restrict__ w = static_cast<const __nv_bfloat16*>(a.w);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, c = lane & 3;
  const int RT = rt_per_block, KS = kWarps / RT;
  const int rt = warp % RT, ks = warp / RT;
  const int tile = blockIdx.x * RT + rt;
  const int steps = (in + kStep - 1) / kStep;
  const int s0 = static_cast<int>(static_cast<int64_t>(steps) * ks / KS);
  const int s1 = static_cast<int>(static_cast<int64_t>(steps) * (ks + 1) / KS);

  // The W rows of MMA rows g and g + 8: consecutive rows, or with kSwiGLU the
  // gate and up rows of feature tile * 8 + g.
  int lo_row, hi_row;
  bool lo_ok, hi_ok;
  if constexpr (kSwiGLU) {
    lo_row = tile * kOutsPerTile + g;
    hi_row = out + lo_row;
    lo_ok = hi_ok = lo_row < out;
  } else {
    lo_row = tile * kTile + g;
    hi_row = lo_row + 8;
    lo_ok = lo_row < out;
    hi_ok = hi_row < out;
  }
  const __nv_bfloat16* w_lo = w + static_cast<int64_t>(lo_ok ? lo_row : 0) * in + 8 * c;
  const __nv_bfloat16* w_hi = w + static_cast<int64_t>(hi_ok ? hi_row : 0) * in + 8 * c;
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
  const auto* x = static_cast<const __nv_bfloat16*>(a.x);
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
  const int outs = RT * kOutsPerTile;  // this block's outputs per batch row
  for (int i = threadIdx.x; i < outs * n; i += kThreads) {
    const int b = i / outs, rr = i % outs;
    const int t = rr / kOutsPerTile, r = rr % kOutsPerTile;
    const int o = blockIdx.x * outs + rr;
    if (o >= out) continue;
    float sum = 0.0f;
    for (int k = 0; k < KS; ++k) sum += partial[k * RT + t][r][b];
    if constexpr (kSwiGLU) {
      float up = 0.0f;
      for (int k = 0; k < KS; ++k) up += partial[k * RT + t][r + 8][b];
      // SwiGLUKernel's expression (kernels/swiglu.cu).
      static_cast<__nv_bfloat16*>(a.act_out)[static_cast<int64_t>(b) * out + o] =
          __float2bfloat16(__fmul_rn(sum / (1.0f + expf(-sum)), up));
    } else {
      float* dst = a.y + static_cast<int64_t>(b) * out + o;
      *dst = a.accumulate ? *dst + sum : sum;
    }
  }
}

template <int NT, int kUnroll>
void LaunchVariant(const SkinnyLinearArgs& a, int blocks, int rt, cudaStream_t stream) {
  if (a.act_out != nullptr) {
    LaunchChained(SkinnyLinearKernel<NT, kUnroll, true>, blocks, kThreads, 0, stream, a, rt);
  } else {
    LaunchChained(SkinnyLinearKernel<NT, kUnroll, false>, blocks, kThreads, 0, stream, a, rt);
  }
}

}  // namespace

bool SkinnyLinearSupported(const SkinnyLinearArgs& a, DType dtype) {
  const auto aligned = [](const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; };
  if (dtype != DType::kBF16 || a.n < 1 || a.n > kSkinnyLinearMaxRows || a.out < 1 || a.in < 8 || a.in % 8 != 0 ||
      a.x == nullptr || !aligned(a.x, 16) || a.w == nullptr || !aligned(a.w, 16)) {
    return false;
  }
  return a.act_out != nullptr ? !a.accumulate : a.y != nullptr;
}

void LaunchSkinnyLinear(const SkinnyLinearArgs& a, cudaStream_t stream) {
  // Warp tiles: 16 output rows each, or 8 features (gate + up rows) with SwiGLU.
  const int tiles = a.act_out ? (a.out + kTile / 2 - 1) / (kTile / 2) : (a.out + kTile - 1) / kTile;
  const int want_blocks = 2 * DeviceSmCount();
  int rt = kWarps;
  while (rt > 1 && (tiles + rt - 1) / rt < want_blocks) rt /= 2;
  const int blocks = (tiles + rt - 1) / rt;
  if (a.n <= 8) {
    LaunchVariant<1, 8>(a, blocks, rt, stream);
  } else {
    LaunchVariant<2, 4>(a, blocks, rt, stream);
  }
}

}  // namespace penumbra::kernels
