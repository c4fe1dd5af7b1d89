// Split-K decode attention (flash-decoding), see attention_decode.cuh.
//
// Work split: every sequence's keys are cut into `splits` chunks of `chunk`
// keys (both from max_length, batch and hkv: DecodeSplitPlan); phase 1 runs
// one block per (kv head, split, sequence), and blocks whose chunk starts past
// their sequence's length exit at once. Phase 2 (merge) runs one block per
// (query head, sequence) over that sequence's valid splits.
//
// Fast phase 1 (bf16, d=128, group hq/hkv in {1, 2, 4, 8}): 256 threads; a
// half-warp owns one key row (16 lanes x 16 bytes), 8 rows per lane in flight
// per batch of loads. Keys go in tiles of 256: pass 1 computes the scores of
// all G query heads of the group (q in registers, pre-scaled by scale*log2 e,
// 16-lane shuffle reduction) into shared memory; the block takes the tile max
// per head and turns scores into probabilities (online softmax across tiles,
// exp2f); pass 2 reads the V rows and accumulates p * v for all G heads in
// registers (8 dims per lane). K and V are each read once from HBM per group.
// The 16 half-warp partials are summed through shared memory at the end.
//
// Generic phase 1 (any d, f32/bf16/f16, any group): one block per (query head,
// split, sequence), one key per thread for the scores, one dim per thread for
// p * v. Writes the same partials, merged by the same phase 2.
//
// Workspace (f32): partial o [batch][hq][splits][d] (unnormalized, relative to
// its own max), then m [batch][hq][splits] (log2 domain) and l [batch][hq][splits].
//
// Traffic: 2 * sum(lengths) * hkv * d * 2 bytes (bf16) + partials
// (batch * hq * splits * (d + 2) * 4 bytes, written once, read once).
#include "kernels/attention_decode.cuh"

#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"

namespace penumbra::kernels {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// ---- split plan ----------------------------------------------------------------

// Phase-1 blocks to aim for: 8 per SM on a 132-SM H100, i.e. 4 whole waves of
// the 2 resident fast-path blocks per SM (8 for group 8), so that equal-length
// batches have no ragged last wave.
constexpr int64_t kTargetBlocks = 132 * 8;
constexpr int kDecodeTile = 256;  // keys per fast-path tile; also the shortest chunk
constexpr int kChunkAlign = 64;   // chunks are multiples of this (finer than a tile: whole waves)

struct SplitPlan {
  int splits = 1;
  int chunk = kDecodeTile;  // keys per split
};

// Depends on (batch, hkv, max_length) only. splits never grows as hkv grows,
// so the plan for hkv = 1 bounds the workspace for any hkv.
SplitPlan DecodeSplitPlan(int batch, int hkv, int max_length) {
  const int64_t len = std::max(max_length, 1);
  const int64_t units = std::max<int64_t>(1, static_cast<int64_t>(std::max(batch, 1)) * std::max(hkv, 1));
  int64_t want = (kTargetBlocks + units - 1) / units;
  const int64_t max_splits = (len + kDecodeTile - 1) / kDecodeTile;
  want = std::clamp<int64_t>(want, 1, max_splits);
  int64_t chunk = (len + want - 1) / want;
  chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  SplitPlan plan;
  plan.chunk = static_cast<int>(chunk);
  plan.splits = static_cast<int>((len + chunk - 1) / chunk);
  return plan;
}

size_t WorkspaceBytesFor(int batch, int hq, int d, int splits) {
  return sizeof(float) * static_cast<size_t>(batch) * hq * splits * (static_cast<size_t>(d) + 2);
}

// ---- fast phase 1: bf16, d = 128 ---------------------------------------------------

constexpr int kFastD = 128;
constexpr int kFastThreads = 256;
constexpr int kFastWarps = kFastThreads / 32;
constexpr int kHalfWarps = kFastThreads / 16;
constexpr int kRowsPerLane = kDecodeTile / kHalfWarps;  // 16
// Rows in flight per lane: 8, or 4 for G = 8 (whose q and accumulators take
// 128 registers already).
template <int G>
constexpr int kUnroll = G >= 8 ? 4 : 8;
// Blocks per SM the register budget is set for.
template <int G>
constexpr int kMinBlocks = G >= 8 ? 1 : 2;

__device__ __forceinline__ void Bf16x8ToF32(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint4 LoadRow16(const __nv_bfloat16* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

template <int G>
__global__ void __launch_bounds__(kFastThreads, kMinBlocks<G>)
    DecodeBf16Kernel(const __nv_bfloat16* __restrict__ q, const void* const* __restrict__ k_ptrs,
                     const void* const* __restrict__ v_ptrs, const int32_t* __restrict__ lengths,
                     float* __restrict__ ws_o, float* __restrict__ ws_m, float* __restrict__ ws_l, int64_t head_stride,
                     int hq, int chunk, int splits, float scale_log2) {
  static_assert(G >= 1 && G <= kFastWarps, "one warp per head for the tile max");
  __shared__ float s_p[G][kDecodeTile];
  __shared__ float s_m[G], s_l[G], s_alpha[G];
  __shared__ float s_red[kFastWarps][G][kFastD];

  const int kvh = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int len = lengths[b];
  const int start = split * chunk;
  if (start >= len) return;
  const int end = min(start + chunk, len);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int hw = tid >> 4, sl = tid & 15;

  const __nv_bfloat16* kb =
      static_cast<const __nv_bfloat16*>(k_ptrs[b]) + static_cast<int64_t>(kvh) * head_stride + sl * 8;
  const __nv_bfloat16* vb =
      static_cast<const __nv_bfloat16*>(v_ptrs[b]) + static_cast<int64_t>(kvh) * head_stride + sl * 8;

  float qf[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const __nv_bfloat16* qr = q + (static_cast<int64_t>(b) * hq + kvh * G + g) * kFastD + sl * 8;
    Bf16x8ToF32(LoadRow16(qr), qf[g]);
#pragma unroll
    for (int e = 0; e < 8; ++e) qf[g][e] *= scale_log2;
  }
  if (tid < G) {
    s_m[tid] = -INFINITY;
    s_l[tid] = 0.0f;
  }
  float acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;

  for (int t0 = start; t0 < end; t0 += kDecodeTile) {
    // Pass 1: scores of key row (t0 + hw + 16 * r) for all G heads.
#pragma unroll 1
    for (int r0 = 0; r0 < kRowsPerLane; r0 += kUnroll<G>) {
      uint4 kr[kUnroll<G>];
#pragma unroll
      for (int u = 0; u < kUnroll<G>; ++u) {
        const int key = t0 + hw + kHalfWarps * (r0 + u);
        kr[u] = key < end ? LoadRow16(kb + static_cast<int64_t>(key) * kFastD) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll<G>; ++u) {
        float kf[8];
        Bf16x8ToF32(kr[u], kf);
        float s[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float x = 0.0f;
#pragma unroll
          for (int e = 0; e < 8; ++e) x = fmaf(qf[g][e], kf[e], x);
          s[g] = x;
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
          for (int o = 8; o > 0; o >>= 1) s[g] += __shfl_xor_sync(0xffffffffu, s[g], o);
        }
        const int local = hw + kHalfWarps * (r0 + u);
        const bool valid = t0 + local < end;
#pragma unroll
        for (int g = 0; g < G; ++g)
          if (sl == g) s_p[g][local] = valid ? s[g] : -INFINITY;
      }
    }
    __syncthreads();
    // Tile max and probabilities, one warp per head.
    if (warp < G) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < kDecodeTile / 32; ++i) mx = fmaxf(mx, s_p[warp][lane + 32 * i]);
      mx = WarpMax(mx);
      const float m_old = s_m[warp];
      const float m_new = fmaxf(m_old, mx);  // finite: key t0 < end is valid
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kDecodeTile / 32; ++i) {
        const float p = exp2f(s_p[warp][lane + 32 * i] - m_new);
        s_p[warp][lane + 32 * i] = p;
        sum += p;
      }
      sum = WarpSum(sum);
      __syncwarp();
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_new);
        s_alpha[warp] = alpha;
        s_m[warp] = m_new;
        s_l[warp] = s_l[warp] * alpha + sum;
      }
    }
    __syncthreads();
    // Pass 2: acc = alpha * acc + sum_rows p * v.
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float alpha = s_alpha[g];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
    }
#pragma unroll 1
    for (int r0 = 0; r0 < kRowsPerLane; r0 += kUnroll<G>) {
      uint4 vr[kUnroll<G>];
#pragma unroll
      for (int u = 0; u < kUnroll<G>; ++u) {
        const int key = t0 + hw + kHalfWarps * (r0 + u);
        vr[u] = key < end ? LoadRow16(vb + static_cast<int64_t>(key) * kFastD) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll<G>; ++u) {
        float vf[8];
        Bf16x8ToF32(vr[u], vf);
        const int local = hw + kHalfWarps * (r0 + u);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float p = s_p[g][local];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
        }
      }
    }
    __syncthreads();  // s_p is rewritten by the next tile
  }

  // Sum the 16 half-warp partials: the two halves by shuffle, the 8 warps in smem.
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], 16);
  if (lane < 16) {
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) s_red[warp][g][sl * 8 + e] = acc[g][e];
  }
  __syncthreads();
  for (int idx = tid; idx < G * kFastD; idx += kFastThreads) {
    const int g = idx / kFastD, dim = idx % kFastD;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kFastWarps; ++w) sum += s_red[w][g][dim];
    const int64_t slot = (static_cast<int64_t>(b) * hq + kvh * G + g) * splits + split;
    ws_o[slot * kFastD + dim] = sum;
  }
  if (tid < G) {
    const int64_t slot = (static_cast<int64_t>(b) * hq + kvh * G + tid) * splits + split;
    ws_m[slot] = s_m[tid];
    ws_l[slot] = s_l[tid];
  }
}

// ---- generic phase 1 -----------------------------------------------------------

constexpr int kGenericThreads = 128;

__device__ __forceinline__ float BlockReduce128(float v, float* scratch, bool is_max) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  v = is_max ? WarpMax(v) : WarpSum(v);
  __syncthreads();  // scratch free from a previous use
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kGenericThreads / 32; ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
  return r;
}

template <typename T>
__global__ void __launch_bounds__(kGenericThreads)
    DecodeGenericKernel(const T* __restrict__ q, const void* const* __restrict__ k_ptrs,
                        const void* const* __restrict__ v_ptrs, const int32_t* __restrict__ lengths,
                        float* __restrict__ ws_o, float* __restrict__ ws_m, float* __restrict__ ws_l,
                        int64_t head_stride, int hq, int group, int d, int chunk, int splits, float scale_log2) {
  extern __shared__ float gsmem[];  // q [d], acc [d], p [128], scratch [4]
  const int head = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int len = lengths[b];
  const int start = split * chunk;
  if (start >= len) return;
  const int end = min(start + chunk, len);
  const int tid = threadIdx.x;
  float* qs = gsmem;
  float* accs = qs + d;
  float* ps = accs + d;
  float* scratch = ps + kGenericThreads;
  const int kvh = head / group;
  const T* kb = static_cast<const T*>(k_ptrs[b]) + static_cast<int64_t>(kvh) * head_stride;
  const T* vb = static_cast<const T*>(v_ptrs[b]) + static_cast<int64_t>(kvh) * head_stride;
  const int64_t row = static_cast<int64_t>(b) * hq + head;
  for (int e = tid; e < d; e += kGenericThreads) {
    qs[e] = ToF32(q[row * d + e]) * scale_log2;
    accs[e] = 0.0f;
  }
  __syncthreads();
  float m = -INFINITY, l = 0.0f;
  for (int t0 = start; t0 < end; t0 += kGenericThreads) {
    const int key = t0 + tid;
    float s = -INFINITY;
    if (key < end) {
      const T* kr = kb + static_cast<int64_t>(key) * d;
      float x = 0.0f;
      for (int e = 0; e < d; ++e) x += qs[e] * ToF32(kr[e]);
      s = x;
    }
    const float m_new = fmaxf(m, BlockReduce128(s, scratch, true));  // finite: key t0 is valid
    const float alpha = exp2f(m - m_new);
    const float p = key < end ? exp2f(s - m_new) : 0.0f;
    ps[tid] = p;
    l = l * alpha + BlockReduce128(p, scratch, false);  // its barriers also publish ps
    m = m_new;
    const int n = min(kGenericThreads, end - t0);
    for (int e = tid; e < d; e += kGenericThreads) {
      float a = accs[e] * alpha;
      const T* vc = vb + static_cast<int64_t>(t0) * d + e;
      for (int j = 0; j < n; ++j) a += ps[j] * ToF32(vc[static_cast<int64_t>(j) * d]);
      accs[e] = a;
    }
    __syncthreads();  // ps is rewritten by the next tile
  }
  const int64_t slot = row * splits + split;
  for (int e = tid; e < d; e += kGenericThreads) ws_o[slot * d + e] = accs[e];
  if (tid == 0) {
    ws_m[slot] = m;
    ws_l[slot] = l;
  }
}

// ---- phase 2: merge ------------------------------------------------------------

constexpr int kMergeThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kMergeThreads)
    DecodeMergeKernel(const float* __restrict__ ws_o, const float* __restrict__ ws_m, const float* __restrict__ ws_l,
                      const int32_t* __restrict__ lengths, T* __restrict__ out, int hq, int d, int chunk,
                      int splits) {
  const int head = blockIdx.x, b = blockIdx.y;
  const int64_t row = static_cast<int64_t>(b) * hq + head;
  const int n = min(splits, (max(lengths[b], 1) + chunk - 1) / chunk);
  const float* m = ws_m + row * splits;
  const float* l = ws_l + row * splits;
  float mx = -INFINITY;
  for (int s = 0; s < n; ++s) mx = fmaxf(mx, m[s]);
  float total = 0.0f;
  for (int s = 0; s < n; ++s) total += exp2f(m[s] - mx) * l[s];
  const float inv = 1.0f / total;
  for (int e = threadIdx.x; e < d; e += kMergeThreads) {
    float acc = 0.0f;
    for (int s = 0; s < n; ++s) acc += exp2f(m[s] - mx) * ws_o[(row * splits + s) * d + e];
    out[row * d + e] = FromF32<T>(acc * inv);
  }
}

template <int G>
void LaunchDecodeBf16(const DecodeAttentionArgs& a, const SplitPlan& plan, float* ws_o, float* ws_m, float* ws_l,
                      cudaStream_t stream) {
  const dim3 grid(a.hkv, plan.splits, a.batch);
  DecodeBf16Kernel<G><<<grid, kFastThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(a.q), a.k, a.v,
                                                        a.lengths, ws_o, ws_m, ws_l, a.head_stride, a.hq, plan.chunk,
                                                        plan.splits, a.scale * kLog2e);
}

template <typename T>
void LaunchDecodeGeneric(const DecodeAttentionArgs& a, const SplitPlan& plan, float* ws_o, float* ws_m, float* ws_l,
                         cudaStream_t stream) {
  const dim3 grid(a.hq, plan.splits, a.batch);
  const size_t smem = sizeof(float) * (2 * static_cast<size_t>(a.d) + kGenericThreads + 4);
  if (smem > 48 * 1024)
    (void)cudaFuncSetAttribute(DecodeGenericKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
  DecodeGenericKernel<T><<<grid, kGenericThreads, smem, stream>>>(static_cast<const T*>(a.q), a.k, a.v, a.lengths,
                                                                 ws_o, ws_m, ws_l, a.head_stride, a.hq,
                                                                 a.hq / a.hkv, a.d, plan.chunk, plan.splits,
                                                                 a.scale * kLog2e);
}

}  // namespace

size_t DecodeAttentionWorkspaceBytes(int batch, int hq, int d, int max_length) {
  return WorkspaceBytesFor(batch, hq, d, DecodeSplitPlan(batch, 1, max_length).splits);
}

void LaunchDecodeAttention(const DecodeAttentionArgs& args, cudaStream_t stream) {
  if (args.batch <= 0 || args.hq <= 0) return;
  SplitPlan plan = DecodeSplitPlan(args.batch, args.hkv, args.max_length);
  // A smaller workspace than DecodeAttentionWorkspaceBytes() asks for: fewer,
  // longer splits (still covering max_length).
  while (plan.splits > 1 && WorkspaceBytesFor(args.batch, args.hq, args.d, plan.splits) > args.workspace_bytes) {
    plan.chunk *= 2;
    plan.splits = (std::max(args.max_length, 1) + plan.chunk - 1) / plan.chunk;
  }
  const size_t rows = static_cast<size_t>(args.batch) * args.hq * plan.splits;
  float* ws_o = static_cast<float*>(args.workspace);
  float* ws_m = ws_o + rows * args.d;
  float* ws_l = ws_m + rows;
  const int group = args.hq / args.hkv;
  if (args.dtype == DType::kBF16 && args.d == kFastD) {
    switch (group) {
      case 1: LaunchDecodeBf16<1>(args, plan, ws_o, ws_m, ws_l, stream); break;
      case 2: LaunchDecodeBf16<2>(args, plan, ws_o, ws_m, ws_l, stream); break;
      case 4: LaunchDecodeBf16<4>(args, plan, ws_o, ws_m, ws_l, stream); break;
      case 8: LaunchDecodeBf16<8>(args, plan, ws_o, ws_m, ws_l, stream); break;
      default: LaunchDecodeGeneric<__nv_bfloat16>(args, plan, ws_o, ws_m, ws_l, stream); break;
    }
  } else {
    PENUMBRA_DISPATCH_FLOAT(args.dtype, T, LaunchDecodeGeneric<T>(args, plan, ws_o, ws_m, ws_l, stream));
  }
  const dim3 merge_grid(args.hq, args.batch);
  PENUMBRA_DISPATCH_FLOAT(args.dtype, T,
                          (DecodeMergeKernel<T><<<merge_grid, kMergeThreads, 0, stream>>>(
                              ws_o, ws_m, ws_l, args.lengths, static_cast<T*>(args.out), args.hq, args.d,
                              plan.chunk, plan.splits)));
}

}  // namespace penumbra::kernels
