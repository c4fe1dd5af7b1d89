// ShadowKV decode, stages 1-2: the chunk scores (Algorithm 2), the top-k
// selection (fused with the slot update), the context-parallel global
// selection, and MaxRows. Contracts in shadowkv_decode.cuh.
#include "kernels/shadowkv_decode.cuh"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>
#include <glog/logging.h>
#include <cub/block/block_scan.cuh>

#include "kernels/common.cuh"
#include "kernels/cuda_check.h"
#include "kernels/landmark_format.h"
#include "kernels/mma.cuh"
#include "kernels/shadowkv_decode_common.cuh"
#include "kernels/shadowkv_slot_update.cuh"
#include "kernels/topk.cuh"
#include "kernels/topk_block.cuh"

namespace penumbra::kernels {

namespace {

// ============================================================================
// 1. Scores
// ============================================================================
constexpr int kScoreThreads = 256;
constexpr int kScoreSplit = 1024;  // chunks per phase-1 block of the SIMT kernel (its shared logits)
// Chunks per block of the tensor-core kernel. 512 rather than 1024: in the
// decode pipeline (124928 x 14, two lanes, forced 60%, chained launches) 595.7
// tok/s against 588.3; 256 measured 593.4 (bench/results/2026-11-21-h200-chained.jsonl).
constexpr int kScoreMmaSplit = 512;
// The workspace holds the split statistics of the smaller of the two.
constexpr int kScoreMinSplit = kScoreMmaSplit < kScoreSplit ? kScoreMmaSplit : kScoreSplit;
constexpr int kScoreUnroll = 8;  // rows in flight per thread
constexpr int kScoreFinalPerThread = 4;

// Phase 1 scores landmark rows: landmarks_per_chunk (S) per chunk, row v of
// chunk v >> shift; phase 2 scores chunks, each by its best row.
struct ScoreWorkspace {
  float* logits;   // [batch * hq][rows]
  float2* splits;  // [batch * hq][n_split] (max, sum exp) per split
  float2* merged;  // [batch * hq] (max, sum exp)
  int32_t* topk;   // the selection's split top-k candidates (TopKArgs::split_workspace)
  int64_t topk_ints;
  int split;  // landmark rows per phase-1 block: kScoreMmaSplit or kScoreSplit
  int rows;   // logits per head: max_chunks * S
  int shift;  // log2(S)
};
int ScoreSplits(int max_rows, int split) { return std::max(1, (max_rows + split - 1) / split); }
int Log2(int s) {
  int l = 0;
  while ((1 << l) < s) ++l;
  return l;
}
// The logits' part of the workspace (the row-by-row paths).
size_t LogitsPartBytes(int batch, int hq, int max_chunks, int per_chunk) {
  return AlignUp(sizeof(float) * static_cast<size_t>(batch) * hq * std::max(max_chunks * per_chunk, 1));
}
// The selection's part (rows: batch x KV heads <= batch x hq).
int64_t TopKInts(int batch, int hq, int max_chunks) {
  return static_cast<int64_t>(batch) * hq * TopKSplitWorkspaceIntsPerRow(max_chunks);
}
// A one-prefix call's workspace: the shared scores' part, then the selection's.
size_t OnePrefixBytes(int batch, int hq, int max_chunks, int per_chunk) {
  return AlignUp(ShadowkvSharedScoresWorkspaceBytes(batch, hq, max_chunks, per_chunk)) +
         sizeof(int32_t) * static_cast<size_t>(TopKInts(batch, hq, max_chunks));
}
// Whether LaunchShadowkvScore takes the one-prefix path for `a` (after its
// early returns: batch > 0, max_chunks > 0).
bool TakesOnePrefix(const ShadowkvScoreArgs& a) {
  return a.one_prefix && a.select_k > 0 && a.stats_out == nullptr && a.stats_in == nullptr && a.successors == 0 &&
         a.batch >= 2 && ShadowkvSharedScoresCovers(a);
}

ScoreWorkspace CarveScoreWorkspace(void* base, int batch, int hq, int max_chunks, int per_chunk, int split) {
  char* p = static_cast<char*>(base);
  ScoreWorkspace w{};
  w.split = split;
  w.rows = max_chunks * per_chunk;
  w.shift = Log2(per_chunk);
  w.logits = reinterpret_cast<float*>(p);
  p += LogitsPartBytes(batch, hq, max_chunks, per_chunk);
  w.splits = reinterpret_cast<float2*>(p);
  p += AlignUp(sizeof(float2) * static_cast<size_t>(batch) * hq * ScoreSplits(w.rows, kScoreMinSplit));
  w.merged = reinterpret_cast<float2*>(p);
  p += AlignUp(sizeof(float2) * static_cast<size_t>(batch) * hq);
  w.topk_ints = TopKInts(batch, hq, max_chunks);
  w.topk = w.topk_ints > 0 ? reinterpret_cast<int32_t*>(p) : nullptr;
  return w;
}

// Phase 1: grid (split, kv head, sequence). A group of `tpr` lanes owns one
// landmark row (one 8-element vector per lane), the block walks the split's
// rows kScoreUnroll at a time.
template <typename T, int G>
__global__ void __launch_bounds__(kScoreThreads)
    ScoreLogitsKernel(ShadowkvScoreArgs a, ScoreWorkspace ws, int tpr, int n_split) {
  __shared__ float s_logit[G][kScoreSplit];
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int n = a.n_chunks[b] << ws.shift;  // landmark rows
  const int c0 = split * ws.split;
  if (c0 >= n) return;  // the merge reads only splits below n
  const int c1 = min(n, c0 + ws.split);
  const int tid = threadIdx.x;
  const int lane_row = tid & (tpr - 1), row_in_pass = tid / tpr, rows_per_pass = kScoreThreads / tpr;
  const int nvec = a.d / 8;
  const bool active = lane_row < nvec;

  float qr[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int64_t off = (static_cast<int64_t>(b) * a.hq + h * G + g) * a.d + lane_row * 8;
#pragma unroll
    for (int j = 0; j < 8; ++j) qr[g][j] = 0.0f;
    if (active) {
      if (a.q_dtype == DType::kF32) {
        Raw8<float> r;
        r.Load(static_cast<const float*>(a.q) + off);
        r.ToF32(qr[g]);
      } else {
        Raw8<bf16> r;
        r.Load(static_cast<const bf16*>(a.q) + off);
        r.ToF32(qr[g]);
      }
    }
  }
  const LandmarkRows<T> land(a, b, h, ws.shift);
  const uint8_t* excl = a.excluded ? a.excluded[b] + static_cast<int64_t>(h) * a.chunk_cap : nullptr;

  for (int base = c0; base < c1; base += rows_per_pass * kScoreUnroll) {
    Raw8<T> raw[kScoreUnroll];
    bool ex[kScoreUnroll];
    float rs[kScoreUnroll];
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      const int c = base + u * rows_per_pass + row_in_pass;
      if (active && c < c1)
        raw[u].Load(land.Row(c) + lane_row * 8);
      else
        raw[u].Zero();
      ex[u] = lane_row == 0 && c < c1 && excl && excl[c >> ws.shift];
      rs[u] = lane_row == 0 && c < c1 ? land.RowScale(c) : 1.0f;
    }
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      float x[8];
      raw[u].ToF32(x);
      float dot[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) s = fmaf(qr[g][j], x[j], s);
        dot[g] = s;
      }
      for (int o = tpr >> 1; o > 0; o >>= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
      }
      const int c = base + u * rows_per_pass + row_in_pass;
      if (lane_row == 0 && c < c1) {
#pragma unroll
        for (int g = 0; g < G; ++g) s_logit[g][c - c0] = ex[u] ? NegInf() : dot[g] * (rs[u] * a.scale);
      }
    }
  }
  __syncthreads();
  const int len = c1 - c0;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float* dst = ws.logits + (static_cast<int64_t>(b) * a.hq + h * G + g) * ws.rows + c0;
    for (int i = tid; i < len; i += kScoreThreads) dst[i] = s_logit[g][i];
  }
  const int warp = tid >> 5, lane = tid & 31;
  if (warp < G) {
    float m = NegInf();
    for (int i = lane; i < len; i += 32) m = fmaxf(m, s_logit[warp][i]);
    m = WarpMax(m);
    float s = 0.0f;
    if (m != NegInf())
      for (int i = lane; i < len; i += 32) s += expf(s_logit[warp][i] - m);
    s = WarpSum(s);
    if (lane == 0) ws.splits[(static_cast<int64_t>(b) * a.hq + h * G + warp) * n_split + split] = make_float2(m, s);
  }
}

// The (max, sum exp) of one query head's ns splits, reduced by one warp (the
// merge kernel and the score-and-select kernel share it, so both give the
// same bits).
__device__ __forceinline__ float2 MergeSplits(const float2* st, int ns, int lane) {
  float m = NegInf();
  for (int i = lane; i < ns; i += 32) m = fmaxf(m, st[i].x);
  m = WarpMax(m);
  float s = 0.0f;
  if (m != NegInf())
    for (int i = lane; i < ns; i += 32)
      if (st[i].x != NegInf()) s += st[i].y * expf(st[i].x - m);
  return make_float2(m, WarpSum(s));
}

// The second of two calls (stats_in): query head idx's (max, sum exp)
// combined over every shard's statistics, reduced by one warp (shared by the
// same two kernels as MergeSplits, for the same reason).
__device__ __forceinline__ float2 CombineParts(const ShadowkvScoreArgs& a, int64_t idx, int lane) {
  const float* st = a.stats_in + idx * 2;
  float m = NegInf();
  for (int p = lane; p < a.stats_parts; p += 32) m = fmaxf(m, st[p * a.stats_part_stride]);
  m = WarpMax(m);
  float s = 0.0f;
  if (m != NegInf()) {
    for (int p = lane; p < a.stats_parts; p += 32) {
      const float mp = st[p * a.stats_part_stride];
      if (mp != NegInf()) s += st[p * a.stats_part_stride + 1] * expf(mp - m);
    }
  }
  return make_float2(m, WarpSum(s));
}

// Phase 1.5: one warp per (sequence, query head) merges the split statistics
// (with stats_in: combines the parts' instead) into ws.merged, or into
// stats_out for the first of two calls.
__global__ void ScoreMergeKernel(ShadowkvScoreArgs a, ScoreWorkspace ws, int n_split) {
  const int idx = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (idx >= a.batch * a.hq) return;
  const int b = idx / a.hq;
  const int ns = ((a.n_chunks[b] << ws.shift) + ws.split - 1) / ws.split;
  const float2 ms = a.stats_in != nullptr ? CombineParts(a, idx, lane)
                                          : MergeSplits(ws.splits + static_cast<int64_t>(idx) * n_split, ns, lane);
  if (lane != 0) return;
  if (a.stats_out != nullptr) {
    a.stats_out[2 * static_cast<int64_t>(idx)] = ms.x;
    a.stats_out[2 * static_cast<int64_t>(idx) + 1] = ms.y;
  } else {
    ws.merged[idx] = ms;
  }
}

// A chunk's score (phase 2): max over the group of exp(logit - max) / sum;
// -inf when excluded.
__device__ __forceinline__ float GroupScore(int group, const float (&m)[8], const float (&s)[8], bool skip,
                                            const float (&lg)[8]) {
  float best = NegInf();
  if (!skip) {
#pragma unroll
    for (int g = 0; g < 8; ++g)
      if (g < group) best = fmaxf(best, expf(lg[g] - m[g]) / s[g]);
  }
  return best;
}

// A chunk's score from the group's logits (the fused selection's keys, and
// the unfused path with successors or several landmarks per chunk): the best
// of its landmark rows c * per_chunk ...
struct GroupScoreSource {
  const float* logits;  // the group's first head; head g at + g * stride
  int64_t stride;
  const uint8_t* excl;  // null: none excluded
  int group;
  int per_chunk;
  float m[8], s[8];
  __device__ __forceinline__ float operator()(int c) const {
    const bool skip = excl && excl[c];
    float best = NegInf();
    for (int j = 0; j < per_chunk; ++j) {
      const int64_t v = static_cast<int64_t>(c) * per_chunk + j;
      float lg[8];
#pragma unroll
      for (int g = 0; g < 8; ++g) lg[g] = g < group ? logits[g * stride + v] : 0.0f;
      best = fmaxf(best, GroupScore(group, m, s, skip, lg));
    }
    return best;
  }
};

// ShadowkvScoreArgs::successors: a selectable chunk's score is the best of
// its own and its `successors` predecessors' (an excluded chunk, -inf, stays
// so and passes nothing on).
template <class Src>
struct SuccessorScoreSource {
  Src base;
  int successors;
  __device__ __forceinline__ float operator()(int c) const {
    float best = base(c);
    if (best == NegInf()) return best;
    for (int j = 1; j <= successors && c - j >= 0; ++j) best = fmaxf(best, base(c - j));
    return best;
  }
};

// Phase 2: scores = max over the group of exp(logit - max) / sum.
__global__ void __launch_bounds__(kScoreThreads) ScoreFinalKernel(ShadowkvScoreArgs a, ScoreWorkspace ws) {
  const int h = blockIdx.y, b = blockIdx.z;
  const int group = a.hq / a.hkv;
  const int n = a.n_chunks[b];
  float m[8], s[8];
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    m[g] = 0.0f;
    s[g] = 1.0f;
    if (g < group) {
      const float2 v = ws.merged[static_cast<int64_t>(b) * a.hq + h * group + g];
      m[g] = v.x;
      s[g] = v.y;
    }
  }
  const uint8_t* excl = a.excluded ? a.excluded[b] + static_cast<int64_t>(h) * a.chunk_cap : nullptr;
  const float* logits = ws.logits + (static_cast<int64_t>(b) * a.hq + h * group) * ws.rows;
  float* out = a.scores + (static_cast<int64_t>(b) * a.hkv + h) * a.score_stride;
  if (a.successors > 0 || ws.shift > 0) {  // each chunk's score from several logits
    GroupScoreSource src{logits, ws.rows, excl, group, 1 << ws.shift, {}, {}};
#pragma unroll
    for (int g = 0; g < 8; ++g) src.m[g] = m[g], src.s[g] = s[g];
    const SuccessorScoreSource<GroupScoreSource> smoothed{src, a.successors};
    for (int j = 0; j < kScoreFinalPerThread; ++j) {
      const int c = (blockIdx.x * kScoreFinalPerThread + j) * kScoreThreads + threadIdx.x;
      if (c >= a.max_chunks) break;
      out[c] = c < n ? smoothed(c) : NegInf();
    }
    return;
  }
  // Every load first (predicated, independent), then the math: with the loads
  // inside the per-chunk branches a thread waited on one load at a time.
  float lg[kScoreFinalPerThread][8];
  bool skip[kScoreFinalPerThread];
#pragma unroll
  for (int j = 0; j < kScoreFinalPerThread; ++j) {
    const int c = (blockIdx.x * kScoreFinalPerThread + j) * kScoreThreads + threadIdx.x;
    skip[j] = c >= n || (excl && excl[c]);
#pragma unroll
    for (int g = 0; g < 8; ++g) lg[j][g] = g < group && c < n ? logits[static_cast<int64_t>(g) * ws.rows + c] : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kScoreFinalPerThread; ++j) {
    const int c = (blockIdx.x * kScoreFinalPerThread + j) * kScoreThreads + threadIdx.x;
    if (c >= a.max_chunks) break;
    out[c] = GroupScore(group, m, s, skip[j], lg[j]);
  }
}

// The selection of one row from `src`, then its selection_scores from the
// same functor (the same bits as the keys) and the slot update.
template <class Src>
__device__ __forceinline__ void SelectScoreUpdateRow(const Src& src, const ShadowkvScoreArgs& a, int row, int n,
                                                     uint32_t* smem, int cached_keys, const ShadowkvSlotUpdateArgs& su,
                                                     bool update) {
  int32_t* sel = a.selection + static_cast<int64_t>(row) * a.selection_stride;
  topk_block::SelectRow(src, n, a.select_k, /*smallest=*/false, /*skip_worst_inf=*/true, sel, smem, cached_keys);
  if (a.selection_scores == nullptr && !update) return;
  __syncthreads();  // the selection (global, written by other threads) and the shared memory, for what follows
  if (a.selection_scores != nullptr) {
    float* out = a.selection_scores + static_cast<int64_t>(row) * a.selection_stride;
    for (int64_t i = threadIdx.x; i < a.selection_stride; i += blockDim.x) {
      const int32_t c = i < a.select_k ? sel[i] : -1;
      out[i] = c >= 0 ? src(c) : NegInf();
    }
  }
  if (update) SlotUpdateRow(su, row, smem);
}

// Phase 1.5 + 2 + top-k in one launch (a selection was asked for and every
// row's chunks fit in shared memory): one block of topk_block::kThreads per
// row (sequence, KV head). Warp g merges query head g's split statistics,
// then the top-k computes each chunk's score from the group's logits exactly
// as ScoreFinalKernel does, keeps it in shared memory as a key and selects.
// With selection_scores, the selected chunks' scores are computed again by the
// same functor (the same bits as the keys). update: the row's slot update
// (section 3) follows in the same block, reading the selection the block just
// wrote.
__global__ void __launch_bounds__(topk_block::kThreads)
    ScoreSelectKernel(ShadowkvScoreArgs a, ScoreWorkspace ws, int n_split, int cached_keys, ShadowkvSlotUpdateArgs su,
                      bool update) {
  ChainWait();  // launched chained: see LaunchChained
  ChainRelease();
  extern __shared__ __align__(16) uint32_t sel_smem[];
  __shared__ float2 s_ms[8];
  const int row = blockIdx.x, b = row / a.hkv, h = row % a.hkv;
  const int group = a.hq / a.hkv, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = min(a.n_chunks[b], a.max_chunks);
  if (warp < group) {
    const int idx = b * a.hq + h * group + warp;
    const int ns = ((n << ws.shift) + ws.split - 1) / ws.split;
    const float2 ms = a.stats_in != nullptr ? CombineParts(a, idx, lane)
                                            : MergeSplits(ws.splits + static_cast<int64_t>(idx) * n_split, ns, lane);
    if (lane == 0) s_ms[warp] = ms;
  }
  __syncthreads();
  GroupScoreSource src;
  src.logits = ws.logits + (static_cast<int64_t>(b) * a.hq + h * group) * ws.rows;
  src.stride = ws.rows;
  src.excl = a.excluded ? a.excluded[b] + static_cast<int64_t>(h) * a.chunk_cap : nullptr;
  src.group = group;
  src.per_chunk = 1 << ws.shift;
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    src.m[g] = g < group ? s_ms[g].x : 0.0f;
    src.s[g] = g < group ? s_ms[g].y : 1.0f;
  }
  if (a.successors > 0) {
    SelectScoreUpdateRow(SuccessorScoreSource<GroupScoreSource>{src, a.successors}, a, row, n, sel_smem, cached_keys,
                         su, update);
  } else {
    SelectScoreUpdateRow(src, a, row, n, sel_smem, cached_keys, su, update);
  }
}

// The unfused path's selection scores: one block per row reads the selected
// chunks' scores.
__global__ void SelectionScoresKernel(ShadowkvScoreArgs a) {
  const int64_t row = blockIdx.x;
  const int32_t* sel = a.selection + row * a.selection_stride;
  const float* scores = a.scores + row * a.score_stride;
  float* out = a.selection_scores + row * a.selection_stride;
  for (int64_t i = threadIdx.x; i < a.selection_stride; i += blockDim.x) {
    const int32_t c = i < a.select_k ? sel[i] : -1;
    out[i] = c >= 0 ? scores[c] : NegInf();
  }
}

// The unfused paths' end, from a.scores: with a selection its top-k (split
// workspace: topk, null where there are no chunks), then its selection
// scores where asked, then the slot update.
void SelectFromScores(const ShadowkvScoreArgs& a, bool with_selection, int32_t* topk, int64_t topk_ints,
                      const ShadowkvSlotUpdateArgs* then_update, cudaStream_t stream) {
  if (!with_selection) return;  // then_update needs a selection (checked by the caller)
  TopKArgs t = ShadowkvSelectionTopK(a);
  t.split_workspace = topk;
  t.split_workspace_ints = topk_ints;
  LaunchTopK(t, stream);
  if (a.selection_scores != nullptr) {
    SelectionScoresKernel<<<a.batch * a.hkv, kScoreThreads, 0, stream>>>(a);
    PENUMBRA_CUDA_CHECK(cudaGetLastError());
  }
  if (then_update) LaunchShadowkvSlotUpdate(*then_update, stream);
}

// Phase 1 on tensor cores (bf16 q and landmarks, d in {64, 128}, group in
// {1, 2, 4, 8}): the QK^T half of the decode-attention kernel, with the same
// helpers (LoadPermutedQ/K, MmaPermutedQK in kernels/mma.cuh): S = Q . L^T with
// the group's query heads as rows (zero-padded), 4 warps each walking 2 x 16
// landmarks per iteration with its own (max, sum exp) per head, merged per
// block. Same outputs as ScoreLogitsKernel: logits and per-split statistics.
constexpr int kScoreMmaWarps = 4;
static_assert(kScoreMmaSplit % (kScoreMmaWarps * 32) == 0, "a split is whole passes of the block's warps");

template <int G, int D, bool F8>
__global__ void __launch_bounds__(kScoreMmaWarps * 32, 4)
    ScoreLogitsMmaKernel(ShadowkvScoreArgs a, ScoreWorkspace ws, int n_split) {
  ChainWait();  // launched chained: see LaunchChained
  ChainRelease();
  constexpr int kJ = D / 32;  // 16-byte loads per landmark row and lane
  __shared__ float s_m[kScoreMmaWarps][8], s_s[kScoreMmaWarps][8];
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int n = a.n_chunks[b] << ws.shift;  // landmark rows
  const int c0 = split * ws.split;
  if (c0 >= n) return;  // the merge reads only splits below n
  const int c1 = min(n, c0 + ws.split);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 2, c = lane & 3;

  uint32_t qa[D / 16][2];  // rows r + 8 are zero
  const bf16* q_row = static_cast<const bf16*>(a.q) + (static_cast<int64_t>(b) * a.hq + h * G + min(r, G - 1)) * D;
  if constexpr (F8)
    LoadPermutedQForFp8K<D>(q_row, r < G, c, qa);
  else
    LoadPermutedQ<D>(q_row, r < G, c, qa);
  const LandmarkRows<std::conditional_t<F8, Fp8, bf16>> land(a, b, h, ws.shift);
  const uint8_t* excl = a.excluded ? a.excluded[b] + static_cast<int64_t>(h) * a.chunk_cap : nullptr;
  float* logit_row = ws.logits + (static_cast<int64_t>(b) * a.hq + h * G + min(r, G - 1)) * ws.rows;
  float m_run = NegInf(), s_run = 0.0f;  // head r; s is this lane's partial sum

#pragma unroll 1
  for (int base = c0 + warp * 32; base < c1; base += kScoreMmaWarps * 32) {
    uint4 kr[4][kJ];
    LoadLandmarkFragments<D, F8>(land, base, c1, r, c, kr);
    // fp8: the scales of this lane's 8 output rows (1 otherwise).
    float rs[4][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int chunk = base + 8 * nt + 2 * c + e;
        rs[nt][e] = F8 && chunk < c1 ? land.RowScale(chunk) : 1.0f;
      }
    // The exclusion flags of this lane's 8 output chunks, loaded beside the
    // landmarks (after the products their latency would add to every step).
    uint32_t ex = 0;  // bit 2 nt + e
    if (excl) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int chunk = base + 8 * nt + 2 * c + e;
          if (chunk < c1 && excl[chunk >> ws.shift]) ex |= 1u << (2 * nt + e);
        }
    }
    float x[4][2];
    float mx = NegInf();
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      MmaPermutedQK<D>(acc, qa, kr[nt]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int chunk = base + 8 * nt + 2 * c + e;
        float v = NegInf();
        if (chunk < c1) {
          v = (ex >> (2 * nt + e)) & 1u ? NegInf() : acc[e] * (rs[nt][e] * a.scale);
          if (r < G) logit_row[chunk] = v;
        }
        x[nt][e] = v;
        mx = fmaxf(mx, v);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    if (m_new != NegInf()) {         // else every chunk so far is excluded: nothing to add
      s_run *= expf(m_run - m_new);  // 0 on the first finite max (s_run is 0 then)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) s_run += expf(x[nt][0] - m_new) + expf(x[nt][1] - m_new);
      m_run = m_new;
    }
  }
  s_run += __shfl_xor_sync(0xffffffffu, s_run, 1);
  s_run += __shfl_xor_sync(0xffffffffu, s_run, 2);
  if (c == 0) {
    s_m[warp][r] = m_run;
    s_s[warp][r] = s_run;
  }
  __syncthreads();
  if (threadIdx.x < G) {
    const int g = threadIdx.x;
    float m = NegInf();
#pragma unroll
    for (int w = 0; w < kScoreMmaWarps; ++w) m = fmaxf(m, s_m[w][g]);
    float sum = 0.0f;
    if (m != NegInf()) {
#pragma unroll
      for (int w = 0; w < kScoreMmaWarps; ++w)
        if (s_m[w][g] != NegInf()) sum += s_s[w][g] * expf(s_m[w][g] - m);
    }
    ws.splits[(static_cast<int64_t>(b) * a.hq + h * G + g) * n_split + split] = make_float2(m, sum);
  }
}

template <int D, bool F8>
bool LaunchScoreLogitsMma(const ShadowkvScoreArgs& a, const ScoreWorkspace& ws, int n_split, cudaStream_t stream) {
  const dim3 grid(n_split, a.hkv, a.batch);
  const auto launch = [&](auto kernel) {
    LaunchChained(kernel, grid, kScoreMmaWarps * 32, 0, stream, a, ws, n_split);
    return true;
  };
  switch (a.hq / a.hkv) {
    case 1:
      return launch(ScoreLogitsMmaKernel<1, D, F8>);
    case 2:
      return launch(ScoreLogitsMmaKernel<2, D, F8>);
    case 4:
      return launch(ScoreLogitsMmaKernel<4, D, F8>);
    case 8:
      return launch(ScoreLogitsMmaKernel<8, D, F8>);
    default:
      return false;
  }
}

template <typename T>
void LaunchScoreLogits(const ShadowkvScoreArgs& a, const ScoreWorkspace& ws, int tpr, int n_split,
                       cudaStream_t stream) {
  const dim3 grid(n_split, a.hkv, a.batch);
  switch (a.hq / a.hkv) {
#define PENUMBRA_SCORE_CASE(G)                                                        \
  case G:                                                                             \
    ScoreLogitsKernel<T, G><<<grid, kScoreThreads, 0, stream>>>(a, ws, tpr, n_split); \
    break;
    PENUMBRA_SCORE_CASE(1)
    PENUMBRA_SCORE_CASE(2)
    PENUMBRA_SCORE_CASE(3)
    PENUMBRA_SCORE_CASE(4)
    PENUMBRA_SCORE_CASE(5)
    PENUMBRA_SCORE_CASE(6)
    PENUMBRA_SCORE_CASE(7)
    PENUMBRA_SCORE_CASE(8)
#undef PENUMBRA_SCORE_CASE
    default:
      LOG(FATAL) << "ShadowkvScore: unsupported group size " << a.hq / a.hkv;
  }
}

// ============================================================================
// 2b. Global selection (context parallel)
// ============================================================================
// Candidate i of a row: part i / cand_stride's proposal i % cand_stride, so
// that top-k's ties to the lower index go to the lower part, then the lower i.
struct CandidateSource {
  const float* row0;  // part 0's proposal scores of the row
  int64_t part_stride;
  int cand_stride;
  __device__ __forceinline__ float operator()(int i) const {
    const int p = i / cand_stride;
    return row0[p * part_stride + (i - p * cand_stride)];
  }
};

// One block of topk_block::kThreads per row: the top-k over every part's
// proposals into the row's winners, then this rank's winners mapped to its
// chunk ids, then (update) the row's slot update, as in ScoreSelectKernel.
__global__ void __launch_bounds__(topk_block::kThreads)
    GlobalSelectKernel(ShadowkvGlobalSelectArgs a, int cached_keys, ShadowkvSlotUpdateArgs su, bool update) {
  ChainWait();  // launched chained: see LaunchChained
  ChainRelease();
  extern __shared__ __align__(16) uint32_t gsel_smem[];
  const int row = blockIdx.x;
  const CandidateSource src{a.candidates + static_cast<int64_t>(row) * a.cand_stride, a.part_stride, a.cand_stride};
  int32_t* win = a.winners + static_cast<int64_t>(row) * a.k;
  topk_block::SelectRow(src, a.parts * a.cand_stride, a.k, /*smallest=*/false, /*skip_worst_inf=*/true, win, gsel_smem,
                        cached_keys);
  __syncthreads();  // the winners (global, written by other threads)
  // The winners ascend, so this rank's, [lo, hi), are one run after the
  // `before` winners of lower ranks; `mine` of them.
  const int lo = a.rank * a.cand_stride, hi = lo + a.cand_stride;
  int before = 0, mine = 0;
  for (int i0 = 0; i0 < a.k; i0 += blockDim.x) {
    const int i = i0 + threadIdx.x;
    const int32_t w = i < a.k ? win[i] : -1;
    before += __syncthreads_count(w >= 0 && w < lo);
    mine += __syncthreads_count(w >= lo && w < hi);
  }
  int32_t* sel = a.selection + static_cast<int64_t>(row) * a.selection_stride;
  const int32_t* prop = a.proposals + static_cast<int64_t>(row) * a.cand_stride;
  for (int i = threadIdx.x; i < a.k; i += blockDim.x) {
    const int32_t w = win[i];
    if (w >= lo && w < hi && i - before < a.selection_len) sel[i - before] = prop[w - lo];
  }
  for (int j = mine + threadIdx.x; j < a.selection_len; j += blockDim.x) sel[j] = -1;
  if (!update) return;
  __syncthreads();  // the selection (global, written by other threads), for the slot update
  SlotUpdateRow(su, row, gsel_smem);
}

}  // namespace

namespace {
size_t RowByRowBytes(int batch, int hq, int max_chunks, int landmarks_per_chunk) {
  const int rows = max_chunks * landmarks_per_chunk;
  return LogitsPartBytes(batch, hq, max_chunks, landmarks_per_chunk) +
         AlignUp(sizeof(float2) * static_cast<size_t>(batch) * hq * ScoreSplits(rows, kScoreMinSplit)) +
         AlignUp(sizeof(float2) * static_cast<size_t>(batch) * hq) +
         sizeof(int32_t) * static_cast<size_t>(TopKInts(batch, hq, max_chunks));
}
}  // namespace

size_t ShadowkvScoreWorkspaceBytes(int batch, int hq, int max_chunks, int landmarks_per_chunk) {
  return std::max(RowByRowBytes(batch, hq, max_chunks, landmarks_per_chunk),
                  OnePrefixBytes(batch, hq, max_chunks, landmarks_per_chunk));
}

size_t ShadowkvScoreWorkspaceBytes(const ShadowkvScoreArgs& a) {
  if (a.batch > 0 && a.max_chunks > 0 && TakesOnePrefix(a))
    return OnePrefixBytes(a.batch, a.hq, a.max_chunks, a.landmarks_per_chunk);
  return RowByRowBytes(a.batch, a.hq, a.max_chunks, a.landmarks_per_chunk);
}

void LaunchShadowkvScore(const ShadowkvScoreArgs& a, cudaStream_t stream, const ShadowkvSlotUpdateArgs* then_update) {
  CHECK(a.stats_out == nullptr || a.stats_in == nullptr) << "ShadowkvScore: stats_out and stats_in are two calls";
  CHECK(a.stats_out == nullptr || then_update == nullptr)
      << "ShadowkvScore: a statistics-only call (stats_out) selects nothing to update the slots with";
  if (a.stats_in != nullptr) {
    CHECK(a.stats_parts >= 1 && (a.stats_parts == 1 || a.stats_part_stride >= 2 * static_cast<int64_t>(a.batch) * a.hq))
        << "ShadowkvScore: stats_parts " << a.stats_parts << " stats_part_stride " << a.stats_part_stride;
  }
  if (then_update) {
    CHECK(a.select_k > 0 && then_update->selection == a.selection &&
          then_update->selection_stride == a.selection_stride && then_update->batch == a.batch &&
          then_update->hkv == a.hkv && then_update->kslots <= a.select_k)
        << "ShadowkvScore: the slot update must read this selection";
  }
  if (a.batch <= 0) return;
  // The first of two calls (stats_out) selects nothing.
  const bool with_selection = a.select_k > 0 && a.stats_out == nullptr;
  constexpr int kMergeWarps = 4;
  const int merge_blocks = (a.batch * a.hq + kMergeWarps - 1) / kMergeWarps;
  if (a.max_chunks <= 0) {
    // No chunks: the statistics are (-inf, 0) (the merge reads no split); the
    // selection is still written (all -1, as the CPU backend's).
    if (a.stats_out != nullptr) {
      ScoreWorkspace none{};
      none.split = kScoreSplit;
      ScoreMergeKernel<<<merge_blocks, kMergeWarps * 32, 0, stream>>>(a, none, 0);
      PENUMBRA_CUDA_CHECK(cudaGetLastError());
      return;
    }
    SelectFromScores(a, with_selection, nullptr, 0, then_update, stream);
    return;
  }
  CHECK(a.hkv > 0 && a.hq % a.hkv == 0 && a.hq / a.hkv <= 8) << "ShadowkvScore: hq " << a.hq << " hkv " << a.hkv;
  CHECK(a.d % 8 == 0 && a.d <= 256) << "ShadowkvScore: d " << a.d;
  CHECK_GE(a.score_stride, a.max_chunks);
  CHECK_LE(a.max_chunks, a.chunk_cap);
  const int per_chunk = a.landmarks_per_chunk;
  CHECK(per_chunk >= 1 && per_chunk <= 16 && (per_chunk & (per_chunk - 1)) == 0)
      << "ShadowkvScore: landmarks_per_chunk " << per_chunk << " (a power of two up to 16)";
  CHECK_GE(a.workspace_bytes, ShadowkvScoreWorkspaceBytes(a));
  if (with_selection) {
    CHECK(a.select_k <= kTopKMaxK && a.selection != nullptr && a.selection_stride >= a.select_k)
        << "ShadowkvScore: selection k " << a.select_k << " stride " << a.selection_stride;
  }
  int tpr = 1;
  while (tpr < a.d / 8) tpr <<= 1;
  const int group = a.hq / a.hkv;
  const bool fp8 = a.landmark_fp8;
  CHECK(!fp8 || a.d % 8 == 0) << "ShadowkvScore: fp8 landmarks need d % 8 == 0, got " << a.d;
  const bool mma_ok = (fp8 || a.dtype == DType::kBF16) && a.q_dtype == DType::kBF16 && (a.d == 128 || a.d == 64) &&
                      (group == 1 || group == 2 || group == 4 || group == 8);
  const int split = mma_ok ? kScoreMmaSplit : kScoreSplit;
  // Sequences attached to one prefix: its landmarks scored for all of them
  // in one pass (its own workspace, then the selection's), then the top-k
  // over the scores.
  if (TakesOnePrefix(a)) {
    const size_t shared = AlignUp(ShadowkvSharedScoresWorkspaceBytes(a.batch, a.hq, a.max_chunks, per_chunk));
    const int64_t topk_ints = TopKInts(a.batch, a.hq, a.max_chunks);
    int32_t* topk = topk_ints > 0 ? reinterpret_cast<int32_t*>(static_cast<char*>(a.workspace) + shared) : nullptr;
    CHECK(LaunchShadowkvSharedScores(a, a.workspace, shared, stream));
    SelectFromScores(a, true, topk, topk_ints, then_update, stream);
    return;
  }
  const ScoreWorkspace ws = CarveScoreWorkspace(a.workspace, a.batch, a.hq, a.max_chunks, per_chunk, split);
  const int n_split = ScoreSplits(ws.rows, split);
  // The second call (stats_in) reuses the logits the first left in the
  // workspace: same arguments, so the same split and layout.
  if (a.stats_in == nullptr) {
    if (mma_ok && fp8) {
      CHECK((a.d == 128 ? LaunchScoreLogitsMma<128, true>(a, ws, n_split, stream)
                        : LaunchScoreLogitsMma<64, true>(a, ws, n_split, stream)));
    } else if (mma_ok) {
      CHECK((a.d == 128 ? LaunchScoreLogitsMma<128, false>(a, ws, n_split, stream)
                        : LaunchScoreLogitsMma<64, false>(a, ws, n_split, stream)));
    } else if (fp8) {
      LaunchScoreLogits<Fp8>(a, ws, tpr, n_split, stream);
    } else if (a.dtype == DType::kF32) {
      LaunchScoreLogits<float>(a, ws, tpr, n_split, stream);
    } else {
      CHECK(a.dtype == DType::kBF16) << "ShadowkvScore: landmarks must be f32 or bf16";
      LaunchScoreLogits<bf16>(a, ws, tpr, n_split, stream);
    }
    PENUMBRA_CUDA_CHECK(cudaGetLastError());
  }
  if (a.stats_out != nullptr) {
    ScoreMergeKernel<<<merge_blocks, kMergeWarps * 32, 0, stream>>>(a, ws, n_split);
    PENUMBRA_CUDA_CHECK(cudaGetLastError());
    return;
  }
  if (with_selection && a.max_chunks <= kTopKSharedKeys) {
    const int cached = a.max_chunks;
    size_t smem = topk_block::SharedWords(cached) * sizeof(uint32_t);
    if (then_update) smem = std::max(smem, SlotUpdateSharedBytes(*then_update));
    const int max_dynamic = AllowDynamicSharedMemory(reinterpret_cast<const void*>(&ScoreSelectKernel));
    if (smem <= static_cast<size_t>(max_dynamic)) {
      LaunchChained(ScoreSelectKernel, a.batch * a.hkv, topk_block::kThreads, smem, stream, a, ws, n_split, cached,
                    then_update ? *then_update : ShadowkvSlotUpdateArgs{}, then_update != nullptr);
      PENUMBRA_CUDA_CHECK(cudaGetLastError());
      return;
    }
  }
  ScoreMergeKernel<<<merge_blocks, kMergeWarps * 32, 0, stream>>>(a, ws, n_split);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
  const int per_block = kScoreThreads * kScoreFinalPerThread;
  const dim3 grid((a.max_chunks + per_block - 1) / per_block, a.hkv, a.batch);
  ScoreFinalKernel<<<grid, kScoreThreads, 0, stream>>>(a, ws);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
  SelectFromScores(a, with_selection, ws.topk, ws.topk_ints, then_update, stream);
}

__global__ void MaxRowsKernel(MaxRowsArgs a) {
  for (int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; c < a.cols; c += int64_t{gridDim.x} * blockDim.x) {
    float m = a.accumulate ? a.out[c] : -INFINITY;
    for (int r = 0; r < a.rows; ++r) m = fmaxf(m, a.in[r * a.row_stride + c]);
    a.out[c] = m;
  }
}

void LaunchMaxRows(const MaxRowsArgs& a, cudaStream_t stream) {
  if (a.rows <= 0 || a.cols <= 0) return;
  CHECK_GE(a.row_stride, a.cols);
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((a.cols + threads - 1) / threads, 4096);
  MaxRowsKernel<<<static_cast<int>(blocks), threads, 0, stream>>>(a);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

void LaunchShadowkvGlobalSelect(const ShadowkvGlobalSelectArgs& a, cudaStream_t stream,
                                const ShadowkvSlotUpdateArgs* then_update) {
  if (a.rows <= 0) return;
  CHECK(a.k >= 1 && a.k <= kTopKMaxK) << "ShadowkvGlobalSelect: k " << a.k;
  CHECK(a.parts >= 1 && a.rank >= 0 && a.rank < a.parts)
      << "ShadowkvGlobalSelect: rank " << a.rank << " of " << a.parts << " parts";
  const int64_t n = static_cast<int64_t>(a.parts) * a.cand_stride;
  CHECK(a.cand_stride >= 0 && n <= std::numeric_limits<int32_t>::max())
      << "ShadowkvGlobalSelect: " << a.parts << " parts of " << a.cand_stride << " candidates";
  CHECK(a.parts == 1 || a.part_stride >= static_cast<int64_t>(a.rows) * a.cand_stride)
      << "ShadowkvGlobalSelect: part_stride " << a.part_stride;
  CHECK(a.selection_len >= 0 && a.selection_len <= a.selection_stride)
      << "ShadowkvGlobalSelect: selection_len " << a.selection_len << " stride " << a.selection_stride;
  CHECK(a.winners != nullptr && a.selection != nullptr && a.selection != a.proposals)
      << "ShadowkvGlobalSelect: winners and a selection apart from the proposals";
  if (then_update) {
    CHECK(then_update->selection == a.selection && then_update->selection_stride == a.selection_stride &&
          then_update->batch * then_update->hkv == a.rows && then_update->kslots <= a.selection_len)
        << "ShadowkvGlobalSelect: the slot update must read this selection";
  }
  const auto smem_for = [&](int cached_keys) {
    size_t smem = topk_block::SharedWords(cached_keys) * sizeof(uint32_t);
    if (then_update) smem = std::max(smem, SlotUpdateSharedBytes(*then_update));
    return smem;
  };
  const int max_dynamic = AllowDynamicSharedMemory(reinterpret_cast<const void*>(&GlobalSelectKernel));
  int cached = n <= kTopKSharedKeys ? static_cast<int>(n) : 0;
  // Where the keys and the slot update's bitmaps do not fit together, the
  // top-k re-reads the candidates (L2) in every pass instead.
  if (smem_for(cached) > static_cast<size_t>(max_dynamic)) cached = 0;
  const size_t smem = smem_for(cached);
  CHECK_LE(smem, static_cast<size_t>(max_dynamic))
      << "ShadowkvGlobalSelect: the slot update needs too much shared memory";
  LaunchChained(GlobalSelectKernel, a.rows, topk_block::kThreads, smem, stream, a, cached,
                then_update ? *then_update : ShadowkvSlotUpdateArgs{}, then_update != nullptr);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace penumbra::kernels
