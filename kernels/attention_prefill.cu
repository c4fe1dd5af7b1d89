// Causal prefill attention, FlashAttention-2 style (see attention_prefill.cuh).
//
// Hopper path (bf16, d in {64, 128}, compute capability 9.0): warpgroup MMA,
// described at PrefillWgmmaKernel below (407-418 TFLOP/s at d 128 on an H200).
//
// mma.sync path (the same inputs on other GPUs, 274 TFLOP/s on the H200):
// grid (hq, query tiles of 128). A block of
// 8 warps owns 128 query rows of one head; each warp owns 16 rows and keeps its
// Q fragments, the 16 x d output accumulator (f32) and the running max / sum of
// its rows in registers. K/V tiles of 64 keys stream through shared memory with
// cp.async, three stages (tiles j+1 and j+2 load while tile j computes; one
// barrier per tile, so warps drift and one warp's softmax overlaps another's
// MMAs). S = Q K^T and
// O += P V run on tensor cores (mma.sync m16n8k16 bf16 -> f32, fragments by
// ldmatrix from XOR-swizzled shared memory: conflict-free). Softmax is online,
// in the log2 domain (scores scaled by scale*log2(e), exp2f). Only tiles that
// cross a warp's diagonal are masked; tiles past it are skipped per warp.
// Blocks are ordered head-fastest so the 4 query heads of a KV group and
// neighbouring query tiles run together and share K/V through L2; heavier
// (later) query tiles start first.
//
// Generic path (any d; f32, bf16 or f16): one warp per (query, head), keys in
// chunks of 32 (one per lane), online softmax, f32 accumulation in shared
// memory (attention_tile.cuh's GenericAttendRow, shared with the prefix
// kernel). Simple and exact-ish; used for parity mode and tiny models.
//
// Floor, Llama-3.1-8B layer (hq=32, hkv=8, d=128) over S=124928 causal keys:
//   FLOPs = 2 (QK^T, PV) * 2 * S^2/2 * hq * d = 4 * 7.80e9 * 32 * 128 ~= 1.28e14
//           per layer: ~0.13 s at ~990 TFLOP/s dense bf16 (H100/H200 SXM
//           peak), i.e. ~4.1 s for 32 layers; ~9.8 s at the wgmma kernel's ~415.
//   Bytes = Q + O: 2 * S * hq * d * 2 B = 2.05e9, K + V once from HBM (re-reads
//           hit L2): 2 * S * hkv * d * 2 B = 0.51e9; ~2.6 GB at 3.35 TB/s
//           ~= 0.8 ms per layer.
//   Compute bound by ~250x: tensor-core issue rate is what matters.
#include "kernels/attention_prefill.cuh"

#include <atomic>
#include <cstdint>

#include "kernels/attention_tile.cuh"
#include "kernels/common.cuh"
#include "kernels/mma.cuh"
#include "kernels/wgmma.cuh"

namespace penumbra::kernels {
namespace {

using namespace attention_tile;

// ---- PTX wrappers ------------------------------------------------------------

// Normalizes O and stores rows row_g and row_g + 8 (those below nq), and
// with lse their ln-sum-exp ([nq, hq]; row_m is in the log2 domain).
template <int D>
__device__ __forceinline__ void StoreRows(const float (&o)[D / 8][4], const float (&row_m)[2], const float (&row_l)[2],
                                          __nv_bfloat16* out, float* lse, int row_g, int nq, int hq, int head, int t4) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_l[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int row = row_g + h * 8;
    if (row < nq) {
      __nv_bfloat16* dst = out + (static_cast<int64_t>(row) * hq + head) * D + 2 * t4;
#pragma unroll
      for (int i = 0; i < D / 8; ++i)
        *reinterpret_cast<uint32_t*>(dst + i * 8) = PackBf16(o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
      if (lse != nullptr && t4 == 0) lse[static_cast<int64_t>(row) * hq + head] = (row_m[h] + log2f(l)) * kLn2;
    }
  }
}

// ---- fast path: bf16 tensor cores ---------------------------------------------

constexpr int kBM = 128;          // query rows per block
constexpr int kBN = 64;           // keys per tile
constexpr int kWarps = kBM / 16;  // 16 rows per warp
constexpr int kThreads = kWarps * 32;

// Byte offset of 16-byte chunk `c` of row `r` in a tile with D columns (bf16),
// XOR-swizzled within each group of 8 chunks so that 8 consecutive rows at the
// same logical chunk hit 8 different bank groups.
template <int D>
__device__ __forceinline__ uint32_t SwizzledOffset(int r, int c) {
  return static_cast<uint32_t>((r * D + ((c ^ (r & 7)) << 3)) * 2);
}

// Shared memory: three stages of [K tile | V tile], each kBN x D bf16, so one
// barrier per tile suffices (tile j+2 loads into the stage tile j-1 used). The
// Q tile (kBM x D = the size of one stage) is first loaded into stage 2 and
// moved to registers before that stage is reused.
constexpr int kStages = 3;
template <int D>
constexpr int PrefillSmemBytes() {
  return kStages * 2 * kBN * D * 2;
}

// One block of 8 warps per SM: d=128 needs ~210 registers; d=64 (~150) would
// spill when capped at 128 for two blocks.
template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    PrefillBf16Kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                      const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
                      int64_t head_stride, int q_start, int nq, int hq, int group, float scale_log2) {
  static_assert(D == 64 || D == 128, "fast path is for d in {64, 128}");
  static_assert(kBM * D == 2 * kBN * D, "Q tile must fit one K/V stage");
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kTileBytes = kBN * D * 2;
  constexpr int kStageBytes = 2 * kTileBytes;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t smem_base = SmemAddr(smem);
  // Stage s: K at smem_base + s * 2 * kTileBytes, V right after it.

  const int head = blockIdx.x;
  const int tile = gridDim.y - 1 - blockIdx.y;
  const int m0 = tile * kBM;
  const int kvh = head / group;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int key_end = q_start + min(m0 + kBM, nq);  // keys this block needs, exclusive
  const int n_tiles = (key_end + kBN - 1) / kBN;
  const __nv_bfloat16* kb = k + static_cast<int64_t>(kvh) * head_stride;
  const __nv_bfloat16* vb = v + static_cast<int64_t>(kvh) * head_stride;

  auto load_q = [&](uint32_t dst) {
#pragma unroll
    for (int i = 0; i < kBM * kChunks / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / kChunks, ch = c % kChunks;
      const int row = m0 + r;
      const bool ok = row < nq;
      const __nv_bfloat16* src = q + (static_cast<int64_t>(ok ? row : 0) * hq + head) * D + ch * 8;
      CpAsync16(dst + SwizzledOffset<D>(r, ch), src, ok ? 16 : 0);
    }
  };
  auto load_kv = [&](const __nv_bfloat16* base, int j, uint32_t dst) {
#pragma unroll
    for (int i = 0; i < kBN * kChunks / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / kChunks, ch = c % kChunks;
      const int key = j * kBN + r;
      const bool ok = key < key_end;
      const __nv_bfloat16* src = base + static_cast<int64_t>(ok ? key : 0) * D + ch * 8;
      CpAsync16(dst + SwizzledOffset<D>(r, ch), src, ok ? 16 : 0);
    }
  };

  auto load_tile = [&](int j, int stage) {
    const uint32_t dst = smem_base + stage * kStageBytes;
    load_kv(kb, j, dst);
    load_kv(vb, j, dst + kTileBytes);
  };
  // Prologue: Q into stage 2, tiles 0 and 1 into stages 0 and 1. One commit
  // group per tile (empty past the end) keeps the wait counts uniform.
  load_q(smem_base + 2 * kStageBytes);
  CpAsyncCommit();
  load_tile(0, 0);
  CpAsyncCommit();
  if (n_tiles > 1) load_tile(1, 1);
  CpAsyncCommit();
  CpAsyncWait<2>();
  __syncthreads();

  // Q fragments (A operand): rows 16*warp.., 16-column k-steps.
  uint32_t qf[D / 16][4];
  {
    const int mi = lane >> 3;
    const int r = warp * 16 + (lane & 7) + (mi & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      LdMatrixX4(qf[kk], smem_base + 2 * kStageBytes + SwizzledOffset<D>(r, kk * 2 + (mi >> 1)));
  }

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float row_m[2] = {-INFINITY, -INFINITY};
  float row_l[2] = {0.0f, 0.0f};  // per-thread partial sums; quad-reduced at the end

  const int g = lane >> 2, t4 = lane & 3;
  const int warp_row0 = m0 + warp * 16;      // first row of this warp
  const int pos0 = q_start + warp_row0 + g;  // absolute position of row g
  const int warp_last_pos = q_start + warp_row0 + 15;
  const bool warp_has_rows = warp_row0 < nq;

  int stage = 0;  // j % kStages
  for (int j = 0; j < n_tiles; ++j) {
    const uint32_t k_s = smem_base + stage * kStageBytes;
    const uint32_t v_s = k_s + kTileBytes;
    CpAsyncWait<1>();  // tile j has landed (tile j+1 may be in flight)
    // Tile j is visible to all, and every warp is done with tile j-1's stage
    // (or, at j = 0, with Q), which tile j+2 now overwrites.
    __syncthreads();
    const int refill = stage == 0 ? kStages - 1 : stage - 1;
    if (j + 2 < n_tiles) load_tile(j + 2, refill);
    CpAsyncCommit();
    stage = stage == kStages - 1 ? 0 : stage + 1;

    const int key0 = j * kBN;
    const bool active = warp_has_rows && key0 <= warp_last_pos;
    if (active) {
      float s[kBN / 8][4];
#pragma unroll
      for (int i = 0; i < kBN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
      const int mi = lane >> 3;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < kBN / 16; ++np) {
          uint32_t b[4];
          LdMatrixX4(b, k_s + SwizzledOffset<D>(np * 16 + (lane & 7) + (mi >> 1) * 8, kk * 2 + (mi & 1)));
          MmaBf16(s[2 * np], qf[kk], b[0], b[1]);
          MmaBf16(s[2 * np + 1], qf[kk], b[2], b[3]);
        }
      }
      // Scale into the log2 domain, mask keys past each row's position, softmax.
      ScaleAndMask(s, scale_log2, key0 + kBN - 1 > q_start + warp_row0, key0, t4, pos0);
      OnlineSoftmax(s, o, row_m, row_l);
      // O += P V, P from the S accumulators (C layout == A layout, as bf16).
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
        uint32_t a[4];
        PackP(s, kk, a);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b[4];
          LdMatrixX4Trans(b, v_s + SwizzledOffset<D>(kk * 16 + (lane & 7) + (mi & 1) * 8, dp * 2 + (mi >> 1)));
          MmaBf16(o[2 * dp], a, b[0], b[1]);
          MmaBf16(o[2 * dp + 1], a, b[2], b[3]);
        }
      }
    }
  }

  StoreRows<D>(o, row_m, row_l, out, lse, warp_row0 + g, nq, hq, head, t4);
}

template <int D>
void LaunchPrefillBf16(const PrefillAttentionArgs& a, cudaStream_t stream) {
  constexpr int smem = PrefillSmemBytes<D>();
  if (smem > 48 * 1024)
    (void)cudaFuncSetAttribute(PrefillBf16Kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const dim3 grid(a.hq, (a.nq + kBM - 1) / kBM);
  PrefillBf16Kernel<D>
      <<<grid, kThreads, smem, stream>>>(static_cast<const __nv_bfloat16*>(a.q), static_cast<const __nv_bfloat16*>(a.k),
                                         static_cast<const __nv_bfloat16*>(a.v), static_cast<__nv_bfloat16*>(a.out),
                                         a.lse, a.head_stride, a.q_start, a.nq, a.hq, a.hq / a.hkv, a.scale * kLog2e);
}

// ---- Hopper path: warpgroup MMA (wgmma) ------------------------------------------
//
// Grid (hq, query tiles of 128), 2 warpgroups of 128 threads; warpgroup w owns
// query rows 64 w .. 64 w + 63 of the tile. Q (128 x D) stays in shared memory
// for the whole block; K/V tiles of 128 keys stream through three stages with
// cp.async (all 256 threads load, one barrier per tile, tile j + 2 loading while
// tile j computes). Per tile and warpgroup: S[64 x 128] = Q K^T with Q and K
// from shared memory (K-major), online softmax on the accumulators in
// registers, then O[64 x D] += P V with P from registers (bf16, the
// accumulator layout is the A-fragment layout) and V from shared memory
// (MN-major). Shared-memory tiles use the 128-byte swizzle (kernels/wgmma.cuh).
// Same masking, log2-domain softmax and block order as the mma.sync path.
// The tile loop is attention_tile.cuh's WgmmaAttentionLoop (shared with the
// prefix kernel); this kernel supplies its rows, causal mask and output.
template <int D>
__global__ void __launch_bounds__(kWgThreads, 1)
    PrefillWgmmaKernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                       const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
                       int64_t head_stride, int q_start, int nq, int hq, int group, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  extern __shared__ unsigned char smem[];

  const int head = blockIdx.x;
  const int tile = gridDim.y - 1 - blockIdx.y;
  const int m0 = tile * kWgBM;
  const int kvh = head / group;
  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp_in_wg = (tid >> 5) & 3;
  const int key_end = q_start + min(m0 + kWgBM, nq);  // keys this block needs, exclusive
  const __nv_bfloat16* kb = k + static_cast<int64_t>(kvh) * head_stride;
  const __nv_bfloat16* vb = v + static_cast<int64_t>(kvh) * head_stride;

  const int g = lane >> 2, t4 = lane & 3;
  const int wg_row0 = m0 + wg * 64;                          // first row of this warpgroup
  const int pos0 = q_start + wg_row0 + warp_in_wg * 16 + g;  // absolute position of row g
  const int wg_last_pos = q_start + wg_row0 + 63;
  const bool wg_has_rows = wg_row0 < nq;

  float o[D / 8][4];
  float row_m[2], row_l[2];
  WgmmaAttentionLoop<D>(
      SmemAddr(smem), kb, vb, key_end,
      [&](uint32_t q_s) {  // rows m0 .. m0 + 127 of this head
#pragma unroll
        for (int i = 0; i < kWgBM * kChunks / kWgThreads; ++i) {
          const int c = tid + i * kWgThreads;
          const int r = c / kChunks, ch = c % kChunks;
          const int row = m0 + r;
          const bool ok = row < nq;
          const __nv_bfloat16* src = q + (static_cast<int64_t>(ok ? row : 0) * hq + head) * D + ch * 8;
          CpAsync16(q_s + Sw128Offset(r, ch, kWgBM), src, ok ? 16 : 0);
        }
      },
      // Tiles past the warpgroup's last row's position are skipped.
      [&](int key0) { return !wg_has_rows || key0 > wg_last_pos; },
      // Scale into the log2 domain and mask keys past each row's position.
      [&](int key0) {
        const bool need_mask = key0 + kWgBN - 1 > q_start + wg_row0;
        return
            [&, need_mask, key0](float(&s)[kWgBN / 8][4]) { ScaleAndMask(s, scale_log2, need_mask, key0, t4, pos0); };
      },
      o, row_m, row_l);

  StoreRows<D>(o, row_m, row_l, out, lse, wg_row0 + warp_in_wg * 16 + g, nq, hq, head, t4);
#else
  __trap();  // built without sm_90a; the launcher never selects this path then
#endif
}

template <int D>
void LaunchPrefillWgmma(const PrefillAttentionArgs& a, cudaStream_t stream) {
  constexpr int smem = WgmmaAttentionSmemBytes<D>();
  (void)cudaFuncSetAttribute(PrefillWgmmaKernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const dim3 grid(a.hq, (a.nq + kWgBM - 1) / kWgBM);
  PrefillWgmmaKernel<D><<<grid, kWgThreads, smem, stream>>>(
      static_cast<const __nv_bfloat16*>(a.q), static_cast<const __nv_bfloat16*>(a.k),
      static_cast<const __nv_bfloat16*>(a.v), static_cast<__nv_bfloat16*>(a.out), a.lse, a.head_stride, a.q_start, a.nq,
      a.hq, a.hq / a.hkv, a.scale * kLog2e);
}

// ---- generic path ------------------------------------------------------------

constexpr int kGenericWarps = 4;

template <typename T>
__global__ void __launch_bounds__(kGenericWarps * 32)
    PrefillGenericKernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
                         float* __restrict__ lse, int64_t head_stride, int q_start, int nq, int hq, int group, int d,
                         float scale_log2) {
  extern __shared__ float gsmem[];  // per warp: q [d], o [d], p [32]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGenericWarps + warp;  // (query, head) pair
  if (row >= static_cast<int64_t>(nq) * hq) return;
  const int i = static_cast<int>(row / hq), head = static_cast<int>(row % hq);
  float* qs = gsmem + warp * (2 * d + 32);
  float* os = qs + d;
  float* ps = os + d;
  const T* qrow = q + row * d;
  for (int e = lane; e < d; e += 32) {
    qs[e] = ToF32(qrow[e]) * scale_log2;
    os[e] = 0.0f;
  }
  __syncwarp();
  const T* kb = k + static_cast<int64_t>(head / group) * head_stride;
  const T* vb = v + static_cast<int64_t>(head / group) * head_stride;
  float m, l;
  GenericAttendRow(qs, os, ps, kb, vb, d, 0, q_start + i + 1, lane, m, l);
  const float inv = 1.0f / l;
  T* orow = out + row * d;
  for (int e = lane; e < d; e += 32) orow[e] = FromF32<T>(os[e] * inv);
  if (lse != nullptr && lane == 0) lse[row] = (m + log2f(l)) * kLn2;
}

template <typename T>
void LaunchPrefillGeneric(const PrefillAttentionArgs& a, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(a.nq) * a.hq;
  const int blocks = static_cast<int>((rows + kGenericWarps - 1) / kGenericWarps);
  const size_t smem = sizeof(float) * kGenericWarps * (2 * a.d + 32);
  if (smem > 48 * 1024)
    (void)cudaFuncSetAttribute(PrefillGenericKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
  PrefillGenericKernel<T><<<blocks, kGenericWarps * 32, smem, stream>>>(
      static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v), static_cast<T*>(a.out), a.lse,
      a.head_stride, a.q_start, a.nq, a.hq, a.hq / a.hkv, a.d, a.scale * kLog2e);
}

}  // namespace

void LaunchPrefillAttention(const PrefillAttentionArgs& args, cudaStream_t stream) {
  if (args.nq <= 0 || args.hq <= 0) return;
  const bool tensor_cores = args.dtype == DType::kBF16 && (args.d == 64 || args.d == 128);
  PrefillPath path = args.path;
  if (path == PrefillPath::kAuto)
    path = !tensor_cores ? PrefillPath::kGeneric : DeviceHasWgmma() ? PrefillPath::kWgmma : PrefillPath::kMma;
  if (path == PrefillPath::kWgmma && tensor_cores && DeviceHasWgmma()) {
    if (args.d == 128)
      LaunchPrefillWgmma<128>(args, stream);
    else
      LaunchPrefillWgmma<64>(args, stream);
    return;
  }
  if (path != PrefillPath::kGeneric && tensor_cores) {
    if (args.d == 128)
      LaunchPrefillBf16<128>(args, stream);
    else
      LaunchPrefillBf16<64>(args, stream);
    return;
  }
  PENUMBRA_DISPATCH_FLOAT(args.dtype, T, LaunchPrefillGeneric<T>(args, stream));
}

}  // namespace penumbra::kernels
