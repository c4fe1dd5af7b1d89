// Prefix attention (cascade), see attention_prefix.cuh.
//
// Hopper path (bf16, d in {64, 128}, compute capability 9.0): the warpgroup
// MMA tile loop the prefill kernel runs too (attention_tile.cuh,
// WgmmaAttentionLoop) over a different row set and key range. A block of 2
// warpgroups owns 128 rows of one kv head
// (row r = sequence rows[r / G], query head kvh * G + r % G: the G heads of a
// group and all attached sequences share every K/V tile) and one split of the
// prefix's keys; K/V tiles of 128 keys stream through three cp.async stages.
// No causal mask: only keys past the split's end (in its last tile) are
// masked. Each row's partial output (normalized) and log2-sum-exp go to the
// workspace.
//
// Generic path (any d; f32, f16, bf16): one warp per (row, query head, split),
// keys 32 at a time (one per lane), f32 accumulation in shared memory (the
// prefill kernel's row loop, attention_tile.cuh's GenericAttendRow).
//
// Merge: one block per (query head, row): weights 2^(lse_s - max) over the
// splits and the row's own part (own_lse, natural log, converted), then
// out = sum_s w_s o_s + w_own o_own, normalized.
//
// Floor, Llama-3.1-8B layer (hq 32, hkv 8, d 128), 64 sequences over a
// 124928-token prefix: FLOPs = 2 (QK^T, PV) * 2 * 64 * 32 * 124928 * 128
// = 1.31e11 per layer (4.2e12 per step of 32 layers: ~10 ms at the prefill
// kernel's ~410 TFLOP/s); bytes = the prefix's K/V once, 2 * 8 * 124928 *
// 128 * 2 = 0.51 GB per layer (~0.15 ms at 3.35 TB/s). Compute bound: the
// same work as a decode of 64 separate copies, on tensor cores instead of
// 64 memory-bound reads.
#include "kernels/attention_prefix.cuh"

#include <algorithm>
#include <cstdint>

#include "kernels/attention_tile.cuh"
#include "kernels/common.cuh"
#include "kernels/mma.cuh"
#include "kernels/wgmma.cuh"

namespace penumbra::kernels {
namespace {

using namespace attention_tile;

// ---- split plan ----------------------------------------------------------------

constexpr int kTile = 128;        // keys per wgmma tile; chunks are multiples of it
constexpr int kMaxSplits = 1024;  // the merge keeps the split weights in shared memory

struct PrefixPlan {
  int splits = 1;
  int chunk = kTile;  // keys per split
};

// Blocks to aim for: 2 waves of the wgmma kernel's one block per SM (its work
// per block is equal, so whole waves leave no SM idle), 16 of the generic
// kernel's one-warp blocks per SM; splits of at least min_chunk keys.
PrefixPlan MakePlan(bool wgmma, int n, int hq, int hkv, int keys) {
  const int64_t sms = std::max(DeviceSmCount(), 1);
  const int64_t group = std::max(hq / std::max(hkv, 1), 1);
  const int64_t units = wgmma ? (static_cast<int64_t>(n) * group + 127) / 128 * hkv : static_cast<int64_t>(n) * hq;
  const int64_t target = wgmma ? 2 * sms : 16 * sms;
  const int64_t min_chunk = wgmma ? 1024 : 256;
  const int64_t len = std::max(keys, 1);
  int64_t splits = std::max<int64_t>(1, target / std::max<int64_t>(units, 1));
  splits = std::min({splits, (len + min_chunk - 1) / min_chunk, static_cast<int64_t>(kMaxSplits)});
  int64_t chunk = (len + splits - 1) / splits;
  chunk = (chunk + kTile - 1) / kTile * kTile;
  PrefixPlan p;
  p.chunk = static_cast<int>(chunk);
  p.splits = static_cast<int>((len + chunk - 1) / chunk);
  return p;
}

size_t WorkspaceFor(int n, int hq, int d, int splits) {
  return sizeof(float) * static_cast<size_t>(n) * hq * splits * (static_cast<size_t>(d) + 1);
}

bool UseWgmma(const PrefixAttentionArgs& a) {
  const bool tensor_cores = a.dtype == DType::kBF16 && (a.d == 64 || a.d == 128) && a.hq % a.hkv == 0;
  return tensor_cores && a.path != PrefixPath::kGeneric && DeviceHasWgmma();
}

// ---- Hopper path -----------------------------------------------------------------

static_assert(kWgBN == kTile, "split chunks are whole wgmma tiles");

template <int D>
__global__ void __launch_bounds__(kWgThreads, 1)
    PrefixWgmmaKernel(const __nv_bfloat16* __restrict__ q, const int32_t* __restrict__ rows, int n,
                      const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, int64_t head_stride,
                      int keys, int chunk, int splits, float* __restrict__ ws_o, float* __restrict__ ws_lse, int hq,
                      int group, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  extern __shared__ unsigned char smem[];

  const int m0 = blockIdx.x * kWgBM;
  const int kvh = blockIdx.y;
  const int split = blockIdx.z;
  const int n_rows = n * group;
  const int key_begin = split * chunk;
  const int n_keys = min(keys, key_begin + chunk) - key_begin;  // >= 1
  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp_in_wg = (tid >> 5) & 3;
  const __nv_bfloat16* kb = k + static_cast<int64_t>(kvh) * head_stride + static_cast<int64_t>(key_begin) * D;
  const __nv_bfloat16* vb = v + static_cast<int64_t>(kvh) * head_stride + static_cast<int64_t>(key_begin) * D;

  const int g = lane >> 2, t4 = lane & 3;
  const int wg_row0 = m0 + wg * 64;
  const bool wg_has_rows = wg_row0 < n_rows;

  float o[D / 8][4];
  float row_m[2], row_l[2];
  WgmmaAttentionLoop<D>(
      SmemAddr(smem), kb, vb, n_keys,
      [&](uint32_t q_s) {  // row r: sequence rows[r / group], query head kvh * group + r % group
#pragma unroll
        for (int i = 0; i < kWgBM * kChunks / kWgThreads; ++i) {
          const int c = tid + i * kWgThreads;
          const int r = c / kChunks, ch = c % kChunks;
          const int row = m0 + r;
          const bool ok = row < n_rows;
          const int seq = ok ? rows[row / group] : 0;
          const int head = kvh * group + (ok ? row % group : 0);
          const __nv_bfloat16* src = q + (static_cast<int64_t>(seq) * hq + head) * D + ch * 8;
          CpAsync16(q_s + Sw128Offset(r, ch, kWgBM), src, ok ? 16 : 0);
        }
      },
      [&](int) { return !wg_has_rows; },
      // No causal mask: only keys past the split's end (its last tile) are masked.
      [&](int key0) {
        return [&, key0](float(&s)[kWgBN / 8][4]) {
          ScaleAndMaskFrom(s, scale_log2, key0 + kWgBN > n_keys, key0, t4, n_keys);
        };
      },
      o, row_m, row_l);

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_l[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = wg_row0 + warp_in_wg * 16 + g + h * 8;
    if (row >= n_rows) continue;
    const int head = kvh * group + row % group;
    const int64_t idx = (static_cast<int64_t>(row / group) * hq + head) * splits + split;
    const float inv = 1.0f / l;
    float* dst = ws_o + idx * D + 2 * t4;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<float2*>(dst + i * 8) = make_float2(o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
    if (t4 == 0) ws_lse[idx] = row_m[h] + log2f(l);
  }
#else
  __trap();  // built without sm_90a; the launcher never selects this path then
#endif
}

template <int D>
void LaunchPrefixWgmma(const PrefixAttentionArgs& a, const PrefixPlan& plan, float* ws_o, float* ws_lse,
                       cudaStream_t stream) {
  constexpr int smem = WgmmaAttentionSmemBytes<D>();
  static_assert(smem <= 232448, "exceeds the Hopper shared-memory limit per block");
  (void)AllowDynamicSharedMemory(reinterpret_cast<const void*>(PrefixWgmmaKernel<D>));
  const int group = a.hq / a.hkv;
  const dim3 grid((a.n * group + kWgBM - 1) / kWgBM, a.hkv, plan.splits);
  PrefixWgmmaKernel<D><<<grid, kWgThreads, smem, stream>>>(
      static_cast<const __nv_bfloat16*>(a.q), a.rows, a.n, static_cast<const __nv_bfloat16*>(a.k),
      static_cast<const __nv_bfloat16*>(a.v), a.head_stride, a.keys, plan.chunk, plan.splits, ws_o, ws_lse, a.hq, group,
      a.scale * kLog2e);
}

// ---- generic path ----------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(32)
    PrefixGenericKernel(const T* __restrict__ q, const int32_t* __restrict__ rows, const T* __restrict__ k,
                        const T* __restrict__ v, int64_t head_stride, int keys, int chunk, int splits,
                        float* __restrict__ ws_o, float* __restrict__ ws_lse, int hq, int group, int d,
                        float scale_log2) {
  extern __shared__ float gsmem[];  // q [d], o [d], p [32]
  const int lane = threadIdx.x;
  const int row = blockIdx.x;  // b * hq + head
  const int split = blockIdx.y;
  const int b = row / hq, head = row % hq;
  float* qs = gsmem;
  float* os = qs + d;
  float* ps = os + d;
  const T* qrow = q + (static_cast<int64_t>(rows[b]) * hq + head) * d;
  for (int e = lane; e < d; e += 32) {
    qs[e] = ToF32(qrow[e]) * scale_log2;
    os[e] = 0.0f;
  }
  __syncwarp();
  const int key_begin = split * chunk;
  const int key_end = min(keys, key_begin + chunk);
  const T* kb = k + static_cast<int64_t>(head / group) * head_stride;
  const T* vb = v + static_cast<int64_t>(head / group) * head_stride;
  float m, l;
  GenericAttendRow(qs, os, ps, kb, vb, d, key_begin, key_end, lane, m, l);
  const int64_t idx = static_cast<int64_t>(row) * splits + split;
  const float inv = 1.0f / l;
  for (int e = lane; e < d; e += 32) ws_o[idx * d + e] = os[e] * inv;
  if (lane == 0) ws_lse[idx] = m + log2f(l);
}

// ---- merge -----------------------------------------------------------------------

constexpr int kMergeThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kMergeThreads)
    PrefixMergeKernel(const float* __restrict__ ws_o, const float* __restrict__ ws_lse,
                      const int32_t* __restrict__ rows, const float* own_lse, float* lse_out, T* __restrict__ out,
                      int hq, int d, int splits) {
  __shared__ float w_s[kMaxSplits];
  __shared__ float w_own;
  const int head = blockIdx.x, b = blockIdx.y;
  const int64_t idx = static_cast<int64_t>(b) * hq + head;
  const int64_t out_row = static_cast<int64_t>(rows[b]) * hq + head;
  const float* lse = ws_lse + idx * splits;
  if (threadIdx.x < 32) {
    const float own = own_lse != nullptr ? own_lse[out_row] * kLog2e : -INFINITY;
    float mx = own;
    for (int s = threadIdx.x; s < splits; s += 32) mx = fmaxf(mx, lse[s]);
    mx = WarpMax(mx);
    float total = 0.0f;
    for (int s = threadIdx.x; s < splits; s += 32) {
      const float w = exp2f(lse[s] - mx);
      w_s[s] = w;
      total += w;
    }
    total = WarpSum(total);
    const float wo = own_lse != nullptr ? exp2f(own - mx) : 0.0f;
    const float inv = 1.0f / (total + wo);
    for (int s = threadIdx.x; s < splits; s += 32) w_s[s] *= inv;
    if (threadIdx.x == 0) {
      w_own = wo * inv;
      if (lse_out != nullptr) lse_out[out_row] = (mx + log2f(total + wo)) / kLog2e;  // natural log
    }
  }
  __syncthreads();
  const float* o = ws_o + idx * splits * d;
  T* dst = out + out_row * d;
  for (int e = threadIdx.x; e < d; e += kMergeThreads) {
    float acc = w_own > 0.0f ? w_own * ToF32(dst[e]) : 0.0f;
    for (int s = 0; s < splits; ++s) acc = fmaf(w_s[s], o[static_cast<int64_t>(s) * d + e], acc);
    dst[e] = FromF32<T>(acc);
  }
}

}  // namespace

size_t PrefixAttentionWorkspaceBytes(int n, int hq, int hkv, int d, int keys) {
  return std::max(WorkspaceFor(n, hq, d, MakePlan(true, n, hq, hkv, keys).splits),
                  WorkspaceFor(n, hq, d, MakePlan(false, n, hq, hkv, keys).splits));
}

void LaunchPrefixAttention(const PrefixAttentionArgs& args, cudaStream_t stream) {
  if (args.n <= 0 || args.hq <= 0 || args.keys <= 0) return;
  const bool wgmma = UseWgmma(args);
  PrefixPlan plan = MakePlan(wgmma, args.n, args.hq, args.hkv, args.keys);
  // A smaller workspace than asked for: fewer, longer splits.
  while (plan.splits > 1 && WorkspaceFor(args.n, args.hq, args.d, plan.splits) > args.workspace_bytes) {
    plan.chunk *= 2;
    plan.splits = (args.keys + plan.chunk - 1) / plan.chunk;
  }
  float* ws_o = static_cast<float*>(args.workspace);
  float* ws_lse = ws_o + static_cast<size_t>(args.n) * args.hq * plan.splits * args.d;
  if (wgmma) {
    if (args.d == 128)
      LaunchPrefixWgmma<128>(args, plan, ws_o, ws_lse, stream);
    else
      LaunchPrefixWgmma<64>(args, plan, ws_o, ws_lse, stream);
  } else {
    const dim3 grid(args.n * args.hq, plan.splits);
    const size_t smem = sizeof(float) * (2 * static_cast<size_t>(args.d) + 32);
    PENUMBRA_DISPATCH_FLOAT(args.dtype, T, {
      if (smem > 48 * 1024)
        (void)cudaFuncSetAttribute(PrefixGenericKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(smem));
      PrefixGenericKernel<T><<<grid, 32, smem, stream>>>(
          static_cast<const T*>(args.q), args.rows, static_cast<const T*>(args.k), static_cast<const T*>(args.v),
          args.head_stride, args.keys, plan.chunk, plan.splits, ws_o, ws_lse, args.hq, args.hq / args.hkv, args.d,
          args.scale * kLog2e);
    });
  }
  const dim3 merge_grid(args.hq, args.n);
  PENUMBRA_DISPATCH_FLOAT(args.dtype, T,
                          PrefixMergeKernel<T><<<merge_grid, kMergeThreads, 0, stream>>>(
                              ws_o, ws_lse, args.rows, args.own_lse, args.lse_out, static_cast<T*>(args.out), args.hq,
                              args.d, plan.splits));
}

}  // namespace penumbra::kernels
