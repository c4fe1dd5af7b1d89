// Split-K decode attention (flash-decoding), see attention_decode.cuh.
//
// Work split: every sequence's keys are cut into `splits` chunks of `chunk`
// keys (both from max_length, batch and hkv: DecodeSplitPlan); phase 1 runs
// one block per (kv head, split, sequence), and blocks whose chunk starts past
// their sequence's length exit at once. Phase 2 (merge) runs one block per
// (query head, sequence) over that sequence's valid splits.
//
// Fast phase 1 (bf16, d in {64, 128}, group hq/hkv in {1, 2, 4, 8}): one block
// of 4 warps per (kv head, split, sequence) serves all G query heads of the
// group, so K and V are read once from HBM per group. Scores and P.V run on
// tensor cores (mma.sync) with fragments loaded straight from global memory
// (layout at DecodeMmaKernel); each warp keeps its own online softmax over its
// 16-key steps and the 4 warps merge through shared memory at the end.
//
// Generic phase 1 (any d, f32/bf16/f16, any group): one block per (query head,
// split, sequence), one key per thread for the scores, one dim per thread for
// p * v. Writes the same partials, merged by the same phase 2.
//
// Slot mask (ShadowKV's empty slots, DecodeAttentionArgs::slot_maps): both
// phase-1 kernels treat a masked key as past the end: its K and V rows are not
// read (they may hold stale or uninitialized bytes) and its score is -inf.
// Masking can empty a 16-key step, a warp's keys, a split or a whole sequence,
// so every online-softmax update and merge takes its exponent base as 0 while
// the running max is -inf (no inf - inf), and an empty (sequence, head) comes
// out of phase 2 as out = 0, lse = -inf. The tensor-core kernel takes the mask
// as a template parameter, so the unmasked one is compiled as before (the
// generic kernel's extra work is one uniform branch per tile).
//
// Workspace (f32): partial o [batch][hq][splits][d] (unnormalized, relative to
// its own max), then m [batch][hq][splits] (log2 domain) and l [batch][hq][splits].
//
// Traffic: 2 * sum(lengths) * hkv * d * 2 bytes (bf16) + partials
// (batch * hq * splits * (d + 2) * 4 bytes, written once, read once).
#include "kernels/attention_decode.cuh"

#include <algorithm>
#include <cstdint>

#include <glog/logging.h>

#include "kernels/common.cuh"
#include "kernels/mma.cuh"

namespace penumbra::kernels {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// ---- split plan ----------------------------------------------------------------

// Phase-1 blocks to aim for: ~16 waves of the 4 resident fast-path blocks per
// SM of a 132-SM GPU, so that the ragged last wave costs a few percent at most;
// chunks of at least kMinChunk keys keep the partials (d + 2 floats per query
// head and split) well under 1% of the K/V bytes.
constexpr int64_t kTargetBlocks = 132 * 4 * 16;
constexpr int kMinChunk = 256;   // keys; also the generic path's tile multiple
constexpr int kChunkAlign = 64;  // chunks are multiples of this (4 warps x 16-key steps)

struct SplitPlan {
  int splits = 1;
  int chunk = kMinChunk;  // keys per split
};

// Depends on (batch, hkv, max_length) only. splits never grows as hkv grows,
// so the plan for hkv = 1 bounds the workspace for any hkv.
SplitPlan DecodeSplitPlan(int batch, int hkv, int max_length) {
  const int64_t len = std::max(max_length, 1);
  const int64_t units = std::max<int64_t>(1, static_cast<int64_t>(std::max(batch, 1)) * std::max(hkv, 1));
  int64_t want = (kTargetBlocks + units - 1) / units;
  const int64_t max_splits = (len + kMinChunk - 1) / kMinChunk;
  want = std::clamp<int64_t>(want, 1, max_splits);
  int64_t chunk = (len + want - 1) / want;
  chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  // grid.y (the splits) is at most 65535.
  constexpr int64_t kMaxSplits = 65535;
  if ((len + chunk - 1) / chunk > kMaxSplits) {
    chunk = ((len + kMaxSplits - 1) / kMaxSplits + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  }
  SplitPlan plan;
  plan.chunk = static_cast<int>(chunk);
  plan.splits = static_cast<int>((len + chunk - 1) / chunk);
  return plan;
}

size_t WorkspaceBytesFor(int batch, int hq, int d, int splits) {
  return sizeof(float) * static_cast<size_t>(batch) * hq * splits * (static_cast<size_t>(d) + 2);
}

// ---- fast phase 1: bf16 on tensor cores, d in {64, 128}, group in {1, 2, 4, 8} ----
//
// Block: 4 warps; warp w takes the 16-key steps w, w + 4, ... of the block's
// split, with its own online softmax; the 4 warps merge at the end. Per step:
//   S [16 x 16] = Q [16 x d] . K^T   (rows: the G query heads, zero-padded to 16;
//                                     2 n-tiles of 8 keys, d/16 k-steps)
//   O^T [d x 8] += V^T [d x 16] . P^T (rows: dims, d/16 m-tiles; cols: heads,
//                                     padded to 8; k: the 16 keys)
// Fragments come straight from global memory in 16-byte loads: lane
// (r = lane/4, c = lane%4)
//   Q, K: the permuted head dimension of LoadPermutedQ/K (kernels/mma.cuh);
//      key row 8*nt + r of n-tile nt.
//   V: key rows 2c, 2c+1, 2c+8, 2c+9, 16 bytes at dims 64q + 8r, q < d/64. The
//      lane's own dim i (< d/8) is 64(i/8) + 8r + i%8; m-tile t takes i = 2t as
//      row r and i = 2t + 1 as row r + 8, paired across keys by byte permutes.
// S's C fragment (row = head r, cols = keys 2c, 2c+1) is exactly the B
// fragment of P^T, so probabilities never leave registers. Every load of a warp
// reads whole 32-byte sectors; no shared memory until the final merge.
constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = 32 * kMmaWarps;
constexpr int kStepKeys = 16;

__device__ __forceinline__ uint32_t Word(const uint4& u, int w) {
  return w == 0 ? u.x : w == 1 ? u.y : w == 2 ? u.z : u.w;
}

__device__ __forceinline__ uint4 LoadRow16(const __nv_bfloat16* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ uint4 LoadRow16Or0(const __nv_bfloat16* p, bool valid) {
  return valid ? LoadRow16(p) : make_uint4(0, 0, 0, 0);
}

// DecodeAttentionArgs' slot mask as the phase-1 kernels take it.
struct SlotMask {
  const int32_t* const* maps;  // null: no mask
  int row0, count, rows;
  const void* const* values;  // null: every V row from the sequence's V (DecodeAttentionArgs::slot_values)
  int64_t values_stride;
  int values_chunks;
  // The slot map of sequence b, KV head h; null without a mask.
  __device__ __forceinline__ const int32_t* Map(int b, int h) const {
    return maps != nullptr ? maps[b] + static_cast<int64_t>(h) * count : nullptr;
  }
  // Whether key `key` lies in an empty slot of `map`.
  __device__ __forceinline__ bool Masked(const int32_t* map, int key) const {
    return key >= row0 && key - row0 < count * rows && __ldg(map + (key - row0) / rows) < 0;
  }
  // Key `key`'s V row (sequence b, KV head h; vb: the head's V): in place in
  // the document's values when its slot holds one of the document's chunks.
  template <typename T>
  __device__ __forceinline__ const T* ValueRow(const int32_t* map, int b, int h, int key, const T* vb, int d) const {
    if (values != nullptr && key >= row0 && key - row0 < count * rows) {
      const int s = (key - row0) / rows;
      const int c = __ldg(map + s);
      if (c >= 0 && c < values_chunks)
        return static_cast<const T*>(values[b]) +
               ((static_cast<int64_t>(h) * values_stride + c) * rows + (key - row0 - s * rows)) * d;
    }
    return vb + static_cast<int64_t>(key) * d;
  }
};

// The exponent base of an online-softmax update whose running max is m: m,
// or 0 while every key so far is masked (m = -inf), so that exp2(x - base) is
// 0 for masked scores and the rescale of the (empty) running sums is 0, not NaN.
__device__ __forceinline__ float SoftmaxBase(float m) { return m == -INFINITY ? 0.0f : m; }

// Resident blocks per SM the register budget is set for (d 128 needs ~140
// registers: 64 of K/V fragments in flight, 32 of O^T, 16 of Q).
template <int D>
constexpr int kMmaMinBlocks = D >= 128 ? 3 : 4;

// kMask: compiled with the slot mask (DecodeAttentionArgs::slot_maps); without
// it the kernel is the unmasked one, keys live below `end` and the running max
// finite (the mask's bookkeeping cost 1% at 7 x 124928 on the H200).
template <int G, int D, bool kMask>
__global__ void __launch_bounds__(kMmaThreads, kMmaMinBlocks<D>)
    DecodeMmaKernel(const __nv_bfloat16* __restrict__ q, const void* const* __restrict__ k_ptrs,
                    const void* const* __restrict__ v_ptrs, const int32_t* __restrict__ lengths,
                    float* __restrict__ ws_o, float* __restrict__ ws_m, float* __restrict__ ws_l, int64_t head_stride,
                    int hq, int chunk, int splits, float scale_log2, SlotMask mask) {
  ChainWait();  // launched chained: see LaunchChained
  ChainRelease();
  static_assert(G == 1 || G == 2 || G == 4 || G == 8, "group must fit the 8 columns of O^T");
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  constexpr int kJ = D / 32;  // K loads per key row and lane
  constexpr int kQ = D / 64;  // V loads per key row and lane
  constexpr int kKSteps = D / 16;
  constexpr int kMTiles = D / 16;
  __shared__ float s_m[kMmaWarps][8], s_l[kMmaWarps][8];
  __shared__ float s_o[kMmaWarps][G][D];

  const int kvh = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int len = lengths[b];
  const int start = split * chunk;
  if (start >= len) return;
  const int end = min(start + chunk, len);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 2, c = lane & 3;

  const __nv_bfloat16* kb = static_cast<const __nv_bfloat16*>(k_ptrs[b]) + static_cast<int64_t>(kvh) * head_stride;
  const __nv_bfloat16* vb = static_cast<const __nv_bfloat16*>(v_ptrs[b]) + static_cast<int64_t>(kvh) * head_stride;
  [[maybe_unused]] const int32_t* slot_map = mask.Map(b, kvh);

  // Q's A fragments (rows r < G real, rows r + 8 zero).
  uint32_t qa[kKSteps][2];
  LoadPermutedQ<D>(q + (static_cast<int64_t>(b) * hq + kvh * G + min(r, G - 1)) * D, r < G, c, qa);
  float o[kMTiles][4];
#pragma unroll
  for (int t = 0; t < kMTiles; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
  float m_run = -INFINITY, l_run = 0.0f;  // head r; l is this lane's partial sum
  // The lanes holding heads 2c and 2c+1 (for rescaling O^T's columns).
  const int src0 = (2 * c) * 4, src1 = (2 * c + 1) * 4;

#pragma unroll 1
  for (int key0 = start + warp * kStepKeys; key0 < end; key0 += kMmaWarps * kStepKeys) {
    // Bit j: key key0 + j is attended (below end and not in an empty slot);
    // lanes 16..31 repeat the lookups of lanes 0..15.
    uint32_t live = 0;
    if constexpr (kMask) {
      live = key0 + kStepKeys <= end ? 0xffffu : (1u << (end - key0)) - 1u;
      live &= ~__ballot_sync(0xffffffffu, mask.Masked(slot_map, key0 + (lane & 15)));
    }
    const auto attended = [&](int j) -> bool {
      if constexpr (kMask) return (live >> j) & 1u;
      return key0 + j < end;
    };
    uint4 kr[2][kJ], vr[4][kQ];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int j = 8 * nt + r;
      LoadPermutedK<D>(kb + static_cast<int64_t>(key0 + j) * D, attended(j), c, kr[nt]);
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int j = 2 * c + (kk & 1) + 8 * (kk >> 1);
      const __nv_bfloat16* row;
      if constexpr (kMask)
        row = mask.ValueRow(slot_map, b, kvh, key0 + j, vb, D) + 8 * r;
      else
        row = vb + static_cast<int64_t>(key0 + j) * D + 8 * r;
#pragma unroll
      for (int qq = 0; qq < kQ; ++qq) vr[kk][qq] = LoadRow16Or0(row + 64 * qq, attended(j));
    }
    // Scores.
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      MmaPermutedQK<D>(s[nt], qa, kr[nt]);
    }
    // Online softmax for head r over this step's keys 8nt + 2c + e.
    float x[4];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int nt = i >> 1, e = i & 1;
      x[i] = attended(8 * nt + 2 * c + e) ? s[nt][e] * scale_log2 : -INFINITY;
      mx = fmaxf(mx, x[i]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);  // masked: -inf while every key so far is masked
    const float base = kMask ? SoftmaxBase(m_new) : m_new;
    const float alpha = exp2f(m_run - base);
    m_run = m_new;
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = r < G ? exp2f(x[i] - base) : 0.0f;
    l_run = l_run * alpha + (p[0] + p[1]) + (p[2] + p[3]);
    const float alpha0 = __shfl_sync(0xffffffffu, alpha, src0);
    const float alpha1 = __shfl_sync(0xffffffffu, alpha, src1);
    const uint32_t pb0 = PackBf16(p[0], p[1]), pb1 = PackBf16(p[2], p[3]);
    // O^T = alpha * O^T + V^T P^T.
#pragma unroll
    for (int t = 0; t < kMTiles; ++t) {
      o[t][0] *= alpha0;
      o[t][1] *= alpha1;
      o[t][2] *= alpha0;
      o[t][3] *= alpha1;
      const int qq = t / 4, w = t % 4;
      const uint32_t v0 = Word(vr[0][qq], w), v1 = Word(vr[1][qq], w);
      const uint32_t v2 = Word(vr[2][qq], w), v3 = Word(vr[3][qq], w);
      MmaBf16(o[t], __byte_perm(v0, v1, 0x5410), __byte_perm(v0, v1, 0x7632), __byte_perm(v2, v3, 0x5410),
              __byte_perm(v2, v3, 0x7632), pb0, pb1);
    }
  }

  // Merge the 4 warps: m and l per head, O^T columns 2c and 2c+1.
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  if (c == 0) {
    s_m[warp][r] = m_run;
    s_l[warp][r] = l_run;
  }
#pragma unroll
  for (int t = 0; t < kMTiles; ++t) {
    const int dim0 = 64 * (t / 4) + 8 * r + 2 * (t % 4);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int head = 2 * c + e;
      if (head < G) {
        s_o[warp][head][dim0] = o[t][e];
        s_o[warp][head][dim0 + 1] = o[t][2 + e];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += kMmaThreads) {
    const int head = idx / D, dim = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) mx = fmaxf(mx, s_m[w][head]);
    const float base = SoftmaxBase(mx);
    float acc = 0.0f, l = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) {
      const float f = exp2f(s_m[w][head] - base);  // 0 for a warp without live keys
      acc += f * s_o[w][head][dim];
      l += f * s_l[w][head];
    }
    const int64_t slot = (static_cast<int64_t>(b) * hq + kvh * G + head) * splits + split;
    ws_o[slot * D + dim] = acc;
    if (dim == 0) {
      ws_m[slot] = mx;
      ws_l[slot] = l;
    }
  }
}

// ---- generic phase 1 -----------------------------------------------------------

constexpr int kGenericThreads = 128;

// Max or sum over a block of 128 threads (every thread gets the result).
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
                        int64_t head_stride, int hq, int group, int d, int chunk, int splits, float scale_log2,
                        SlotMask mask) {
  extern __shared__ float gsmem[];                   // q [d], acc [d], p [128], scratch [4]
  __shared__ uint32_t s_live[kGenericThreads / 32];  // with a mask: bit j of word j / 32, key t0 + j is attended
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
  const int32_t* slot_map = mask.Map(b, kvh);
  const int64_t row = static_cast<int64_t>(b) * hq + head;
  for (int e = tid; e < d; e += kGenericThreads) {
    qs[e] = ToF32(q[row * d + e]) * scale_log2;
    accs[e] = 0.0f;
  }
  __syncthreads();
  float m = -INFINITY, l = 0.0f;
  for (int t0 = start; t0 < end; t0 += kGenericThreads) {
    const int key = t0 + tid;
    bool live = key < end;
    if (slot_map != nullptr) {
      live = live && !mask.Masked(slot_map, key);
      const uint32_t bits = __ballot_sync(0xffffffffu, live);
      if ((tid & 31) == 0) s_live[tid >> 5] = bits;
    }
    float s = -INFINITY;
    if (live) {
      const T* kr = kb + static_cast<int64_t>(key) * d;
      float x = 0.0f;
      for (int e = 0; e < d; ++e) x += qs[e] * ToF32(kr[e]);
      s = x;
    }
    const float m_new = fmaxf(m, BlockReduce128(s, scratch, true));  // -inf while every key so far is masked
    const float base = SoftmaxBase(m_new);
    const float alpha = exp2f(m - base);
    const float p = live ? exp2f(s - base) : 0.0f;
    ps[tid] = p;
    l = l * alpha + BlockReduce128(p, scratch, false);  // its barriers also publish ps and s_live
    m = m_new;
    const int n = min(kGenericThreads, end - t0);
    for (int e = tid; e < d; e += kGenericThreads) {
      float a = accs[e] * alpha;
      const T* vc = vb + static_cast<int64_t>(t0) * d + e;
      if (slot_map == nullptr) {
        for (int j = 0; j < n; ++j) a += ps[j] * ToF32(vc[static_cast<int64_t>(j) * d]);
      } else {
        // A masked key's V row is skipped, not multiplied by p = 0: it may hold NaN.
        for (int j = 0; j < n; ++j)
          if ((s_live[j >> 5] >> (j & 31)) & 1u) a += ps[j] * ToF32(mask.ValueRow(slot_map, b, kvh, t0 + j, vb, d)[e]);
      }
      accs[e] = a;
    }
    __syncthreads();  // ps and s_live are rewritten by the next tile
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
constexpr int kMergeMaxSmemSplits = 8192;  // split weights kept in shared memory (32 KiB)

static_assert(kMergeThreads == kGenericThreads, "the merge uses BlockReduce128");

// One block per (query head, sequence). The max and the normalizer over the
// splits are block reductions (a sequence of 124928 keys at batch 1 has ~500
// splits: a serial loop per thread over them cost more than phase 1), the
// per-split weights 2^(m_s - max) / total go to shared memory, then each
// thread sums its dims over the splits with independent loads. A (sequence,
// head) whose every key is masked (every split's m = -inf, l = 0) gets out = 0
// and lse = -inf.
template <typename T>
__global__ void __launch_bounds__(kMergeThreads)
    DecodeMergeKernel(const float* __restrict__ ws_o, const float* __restrict__ ws_m, const float* __restrict__ ws_l,
                      const int32_t* __restrict__ lengths, T* __restrict__ out, float* __restrict__ lse, int hq, int d,
                      int chunk, int splits) {
  ChainWait();  // launched chained: see LaunchChained
  ChainRelease();
  extern __shared__ float w_s[];  // [min(n, kMergeMaxSmemSplits)]
  __shared__ float scratch[kMergeThreads / 32];
  const int head = blockIdx.x, b = blockIdx.y;
  const int64_t row = static_cast<int64_t>(b) * hq + head;
  const int n = min(splits, (max(lengths[b], 1) + chunk - 1) / chunk);
  const float* m = ws_m + row * splits;
  const float* l = ws_l + row * splits;
  float mx = -INFINITY;
  for (int s = threadIdx.x; s < n; s += kMergeThreads) mx = fmaxf(mx, m[s]);
  mx = BlockReduce128(mx, scratch, true);
  const float base = SoftmaxBase(mx);
  float total = 0.0f;
  for (int s = threadIdx.x; s < n; s += kMergeThreads) total += exp2f(m[s] - base) * l[s];
  total = BlockReduce128(total, scratch, false);
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  if (lse != nullptr && threadIdx.x == 0)
    lse[row] = total > 0.0f ? (mx + log2f(total)) * 0.6931471805599453f : -INFINITY;  // log2 -> ln
  const int n_smem = min(n, kMergeMaxSmemSplits);
  for (int s = threadIdx.x; s < n_smem; s += kMergeThreads) w_s[s] = exp2f(m[s] - base) * inv;
  __syncthreads();
  const float* o = ws_o + row * splits * d;
  for (int e = threadIdx.x; e < d; e += kMergeThreads) {
    float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;
    int s = 0;
    for (; s + 4 <= n_smem; s += 4) {
      acc0 = fmaf(w_s[s], o[static_cast<int64_t>(s) * d + e], acc0);
      acc1 = fmaf(w_s[s + 1], o[static_cast<int64_t>(s + 1) * d + e], acc1);
      acc2 = fmaf(w_s[s + 2], o[static_cast<int64_t>(s + 2) * d + e], acc2);
      acc3 = fmaf(w_s[s + 3], o[static_cast<int64_t>(s + 3) * d + e], acc3);
    }
    for (; s < n_smem; ++s) acc0 = fmaf(w_s[s], o[static_cast<int64_t>(s) * d + e], acc0);
    for (; s < n; ++s) acc0 = fmaf(exp2f(m[s] - base) * inv, o[static_cast<int64_t>(s) * d + e], acc0);
    out[row * d + e] = FromF32<T>((acc0 + acc1) + (acc2 + acc3));
  }
}

SlotMask SlotMaskOf(const DecodeAttentionArgs& a) {
  return SlotMask{a.slot_maps,   a.slot_row0,          a.slot_count,        a.slot_rows,
                  a.slot_values, a.slot_values_stride, a.slot_values_chunks};
}

template <int G, int D>
void LaunchDecodeMma(const DecodeAttentionArgs& a, const SplitPlan& plan, float* ws_o, float* ws_m, float* ws_l,
                     cudaStream_t stream) {
  const dim3 grid(a.hkv, plan.splits, a.batch);
  const auto launch = [&](auto kernel) {
    LaunchChained(kernel, grid, kMmaThreads, 0, stream, static_cast<const __nv_bfloat16*>(a.q), a.k, a.v, a.lengths,
                  ws_o, ws_m, ws_l, a.head_stride, a.hq, plan.chunk, plan.splits, a.scale * kLog2e, SlotMaskOf(a));
  };
  if (a.slot_maps != nullptr) {
    launch(DecodeMmaKernel<G, D, true>);
  } else {
    launch(DecodeMmaKernel<G, D, false>);
  }
}

template <int D>
bool LaunchDecodeMmaFor(int group, const DecodeAttentionArgs& a, const SplitPlan& plan, float* ws_o, float* ws_m,
                        float* ws_l, cudaStream_t stream) {
  switch (group) {
    case 1:
      LaunchDecodeMma<1, D>(a, plan, ws_o, ws_m, ws_l, stream);
      return true;
    case 2:
      LaunchDecodeMma<2, D>(a, plan, ws_o, ws_m, ws_l, stream);
      return true;
    case 4:
      LaunchDecodeMma<4, D>(a, plan, ws_o, ws_m, ws_l, stream);
      return true;
    case 8:
      LaunchDecodeMma<8, D>(a, plan, ws_o, ws_m, ws_l, stream);
      return true;
    default:
      return false;
  }
}

template <typename T>
void LaunchDecodeGeneric(const DecodeAttentionArgs& a, const SplitPlan& plan, float* ws_o, float* ws_m, float* ws_l,
                         cudaStream_t stream) {
  const dim3 grid(a.hq, plan.splits, a.batch);
  const size_t smem = sizeof(float) * (2 * static_cast<size_t>(a.d) + kGenericThreads + 4);
  if (smem > 48 * 1024)
    (void)cudaFuncSetAttribute(DecodeGenericKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
  DecodeGenericKernel<T><<<grid, kGenericThreads, smem, stream>>>(
      static_cast<const T*>(a.q), a.k, a.v, a.lengths, ws_o, ws_m, ws_l, a.head_stride, a.hq, a.hq / a.hkv, a.d,
      plan.chunk, plan.splits, a.scale * kLog2e, SlotMaskOf(a));
}

}  // namespace

size_t DecodeAttentionWorkspaceBytes(int batch, int hq, int d, int max_length) {
  return WorkspaceBytesFor(batch, hq, d, DecodeSplitPlan(batch, 1, max_length).splits);
}

void LaunchDecodeAttention(const DecodeAttentionArgs& args, cudaStream_t stream) {
  CHECK(args.slot_values == nullptr || args.slot_maps != nullptr) << "DecodeAttention: slot_values needs slot_maps";
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
  bool fast = false;
  if (args.dtype == DType::kBF16 && args.d == 128) {
    fast = LaunchDecodeMmaFor<128>(group, args, plan, ws_o, ws_m, ws_l, stream);
  } else if (args.dtype == DType::kBF16 && args.d == 64) {
    fast = LaunchDecodeMmaFor<64>(group, args, plan, ws_o, ws_m, ws_l, stream);
  }
  if (!fast) PENUMBRA_DISPATCH_FLOAT(args.dtype, T, LaunchDecodeGeneric<T>(args, plan, ws_o, ws_m, ws_l, stream));
  const dim3 merge_grid(args.hq, args.batch);
  const size_t merge_smem = sizeof(float) * std::min(plan.splits, kMergeMaxSmemSplits);
  PENUMBRA_DISPATCH_FLOAT(
      args.dtype, T,
      LaunchChained(DecodeMergeKernel<T>, merge_grid, kMergeThreads, merge_smem, stream, ws_o, ws_m, ws_l, args.lengths,
                    static_cast<T*>(args.out), args.lse, args.hq, args.d, plan.chunk, plan.splits));
}

}  // namespace penumbra::kernels
