// RoPE + KV-cache store, fused.
// Algorithm: per token, the block first computes cos/sin of
// angle = __fmul_rn(f32(position), inv_freq[i]) for the d/2 frequencies with
// accurate sincosf (the argument reaches ~1e6 at long positions; fast
// intrinsics would be wrong there) into shared memory. Then it rotates pairs
// (i, i + d/2) of every query and key head (rotate-half, HF Llama), writing
// queries to q_out, keys (optionally also pre-RoPE keys) and values to the
// token's KV-cache slot. Products are explicitly rounded (no FMA contraction)
// so results match the CPU reference up to the cos/sin ulps.
// Parallelization: one block per token (grid-stride over tokens); threads take
// 4-wide units (4 consecutive i of one head: two 16-byte loads) when d % 8 == 0
// and qkv is 16-byte aligned, else single pairs. Stores into the cache use the
// 4-wide access only where the slot address is aligned for it.
// Memory traffic: reads (hq + 2*hkv)*d f32 per token, writes hq*d of q_dtype and
// 2*hkv*d of kv_dtype (+ hkv*d f32 pre-RoPE keys when requested).
#include "kernels/rope_store.cuh"

#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/vec.cuh"

namespace penumbra::kernels {
namespace {

constexpr int kThreads = 256;

// Stores N floats to dst as T, with one vector access if dst allows it.
template <typename T, int N>
__device__ __forceinline__ void StoreN(T* dst, const float (&v)[N]) {
  if (N > 1 && reinterpret_cast<uintptr_t>(dst) % (sizeof(T) * N) == 0) {
    Pack<T, N> p;
#pragma unroll
    for (int q = 0; q < N; ++q) p.v[q] = FromF32<T>(v[q]);
    *reinterpret_cast<Pack<T, N>*>(dst) = p;
  } else {
#pragma unroll
    for (int q = 0; q < N; ++q) dst[q] = FromF32<T>(v[q]);
  }
}

template <int N>
__device__ __forceinline__ void LoadN(const float* src, float (&v)[N]) {
  if constexpr (N > 1) {
    const Pack<float, N> p = *reinterpret_cast<const Pack<float, N>*>(src);
#pragma unroll
    for (int q = 0; q < N; ++q) v[q] = p.v[q];
  } else {
    v[0] = src[0];
  }
}

// Rotates and stores every query/key head and copies the value heads of token
// t, N consecutive elements per unit. `cs` holds cos[d/2] then sin[d/2].
template <typename TQ, typename TKV, int N>
__device__ void RopeToken(const RopeStoreArgs& a, int t, const float* cs) {
  const int d = a.d, half = d / 2;
  const float* row = a.qkv + static_cast<int64_t>(t) * (a.hq + 2 * a.hkv) * d;
  TKV* k_slot = static_cast<TKV*>(a.k_dst[t]);
  TKV* v_slot = a.v_dst != nullptr ? static_cast<TKV*>(a.v_dst[t]) : nullptr;
  TQ* q_row = static_cast<TQ*>(a.q_out) + static_cast<int64_t>(t) * a.hq * d;
  const int per_head = half / N;
  const int rot_units = (a.hq + a.hkv) * per_head;
  for (int u = threadIdx.x; u < rot_units; u += blockDim.x) {
    const int head = u / per_head;
    const int j = (u - head * per_head) * N;
    float lo[N], hi[N], out_lo[N], out_hi[N];
    LoadN<N>(row + head * d + j, lo);
    LoadN<N>(row + head * d + half + j, hi);
#pragma unroll
    for (int q = 0; q < N; ++q) {
      const float c = cs[j + q], s = cs[half + j + q];
      out_lo[q] = __fsub_rn(__fmul_rn(lo[q], c), __fmul_rn(hi[q], s));
      out_hi[q] = __fadd_rn(__fmul_rn(hi[q], c), __fmul_rn(lo[q], s));
    }
    if (head < a.hq) {
      StoreN<TQ, N>(q_row + head * d + j, out_lo);
      StoreN<TQ, N>(q_row + head * d + half + j, out_hi);
    } else {
      const int kh = head - a.hq;
      if (a.pre_rope_k_out != nullptr) {
        float* pre = a.pre_rope_k_out + (static_cast<int64_t>(t) * a.hkv + kh) * d;
        StoreN<float, N>(pre + j, lo);
        StoreN<float, N>(pre + half + j, hi);
      }
      if (a.pre_rope_k_dst != nullptr) {
        float* pre = a.pre_rope_k_dst[t] + kh * d;
        StoreN<float, N>(pre + j, lo);
        StoreN<float, N>(pre + half + j, hi);
      }
      TKV* k = k_slot + kh * a.head_stride;
      StoreN<TKV, N>(k + j, out_lo);
      StoreN<TKV, N>(k + half + j, out_hi);
    }
  }
  if (v_slot == nullptr) return;
  const int v_per_head = d / N;
  const float* v_row = row + (a.hq + a.hkv) * d;
  for (int u = threadIdx.x; u < a.hkv * v_per_head; u += blockDim.x) {
    const int kh = u / v_per_head;
    const int j = (u - kh * v_per_head) * N;
    float v[N];
    LoadN<N>(v_row + kh * d + j, v);
    StoreN<TKV, N>(v_slot + kh * a.head_stride + j, v);
  }
}

template <typename TQ, typename TKV>
__global__ void __launch_bounds__(kThreads) RopeStoreKernel(const RopeStoreArgs a, bool vec) {
  ChainWait();  // launched chained: see LaunchChained
  ChainRelease();
  extern __shared__ float cs[];  // cos[d/2], sin[d/2]
  const int half = a.d / 2;
  for (int t = blockIdx.x; t < a.n; t += gridDim.x) {
    const float pos = static_cast<float>(a.positions[t]);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      float s, c;
      sincosf(__fmul_rn(pos, a.inv_freq[i]), &s, &c);
      cs[i] = c;
      cs[half + i] = s;
    }
    __syncthreads();
    if (vec) {
      RopeToken<TQ, TKV, 4>(a, t, cs);
    } else {
      RopeToken<TQ, TKV, 1>(a, t, cs);
    }
    __syncthreads();  // cs is rewritten for the next token
  }
}

}  // namespace

void LaunchRopeStore(const RopeStoreArgs& args, cudaStream_t stream) {
  if (args.n <= 0 || args.d <= 0) return;
  const bool vec = args.d % 8 == 0 && reinterpret_cast<uintptr_t>(args.qkv) % 16 == 0;
  const int grid = std::min(args.n, 65535);
  const size_t smem = sizeof(float) * static_cast<size_t>(args.d);
  PENUMBRA_DISPATCH_FLOAT(
      args.q_dtype, TQ,
      PENUMBRA_DISPATCH_FLOAT(args.kv_dtype, TKV,
                              LaunchChained(RopeStoreKernel<TQ, TKV>, grid, kThreads, smem, stream, args, vec)));
}

}  // namespace penumbra::kernels
