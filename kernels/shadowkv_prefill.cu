#include "kernels/shadowkv_prefill.cuh"

#include <type_traits>

#include <cuda_fp8.h>
#include <cub/block/block_scan.cuh>

#include <glog/logging.h>

#include "kernels/common.cuh"
#include "kernels/landmark_format.h"

namespace penumbra::kernels {
namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kPerLane = kMaxHeadDim / 32;

__device__ __forceinline__ float Cosine(float dot, float xx, float yy) {
  const bool x0 = xx == 0.0f, y0 = yy == 0.0f;
  if (x0 && y0) return 1.0f;
  if (x0 || y0) return 0.0f;
  return dot / (sqrtf(xx) * sqrtf(yy));
}

// L: the landmark type (float, bf16, or uint8_t for fp8 records).
template <typename T, typename L>
__global__ void ChunkLandmarksKernel(ChunkLandmarksArgs a) {
  constexpr bool kFp8 = std::is_same_v<L, uint8_t>;
  const int64_t gwarp = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  const int64_t per_problem = static_cast<int64_t>(a.hkv) * a.n_chunks;
  if (gwarp >= per_problem * a.batch) return;
  const int p = static_cast<int>(gwarp / per_problem);
  const int warp = static_cast<int>(gwarp - p * per_problem);
  const int h = warp / a.n_chunks, c = warp - h * a.n_chunks;
  const int C = a.chunk_tokens, d = a.d;
  const T* keys = static_cast<const T*>(a.k) + p * a.k_batch_stride + h * a.k_head_stride +
                  (a.first_token + static_cast<int64_t>(c) * C) * d;
  const int S = a.landmarks_per_chunk, run = C / S;
  // The mean of keys [t0, t0 + n) (this lane's elements), summed in token order.
  const auto mean_of = [&](int t0, int n, float(&out)[kPerLane]) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) out[i] = 0.0f;
    for (int t = t0; t < t0 + n; ++t) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int j = lane + 32 * i;
        if (j < d) out[i] += ToF32<T>(keys[static_cast<int64_t>(t) * d + j]);
      }
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) out[i] = out[i] / static_cast<float>(n);
  };
  float mean[kPerLane];
  mean_of(0, C, mean);
  float mm = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    if (lane + 32 * i < d) mm += mean[i] * mean[i];
  L* out = static_cast<L*>(a.landmarks) + p * a.landmark_batch_stride + h * a.landmark_head_stride +
           c * LandmarkChunkElems(S, d, kFp8);
  // Row s of the chunk: the mean of its s-th run of C / S keys (S = 1: the chunk's mean).
  const auto row_of = [&](int s, float(&row)[kPerLane]) {
    if (S <= 1) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) row[i] = mean[i];
    } else {
      mean_of(s * run, run, row);
    }
  };
  if constexpr (kFp8) {
    // The record's scale needs its largest value: the rows twice (the second
    // pass over the chunk's keys hits L1).
    float amax = 0.0f;
    for (int s = 0; s < S; ++s) {
      float row[kPerLane];
      row_of(s, row);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i < d && isfinite(row[i])) amax = fmaxf(amax, fabsf(row[i]));
    }
    amax = WarpMax(amax);
    // Rounded as the host's (EncodeLandmarkFp8); non-finite values take no
    // part in the scale and become kE4M3NaN.
    const float inv = amax > 0.0f ? __fdiv_rn(kE4M3Max, amax) : 1.0f;
    const float scale = amax > 0.0f ? __fdiv_rn(amax, kE4M3Max) : 1.0f;
    for (int s = 0; s < S; ++s) {
      float row[kPerLane];
      row_of(s, row);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int j = lane + 32 * i;
        if (j < d) {
          out[static_cast<int64_t>(s) * d + j] =
              isfinite(row[i]) ? __nv_cvt_float_to_fp8(__fmul_rn(row[i], inv), __NV_SATFINITE, __NV_E4M3) : kE4M3NaN;
        }
      }
    }
    // The scale and the zero padding (4-byte stores: a record is 8-byte
    // aligned when d is not a multiple of 16).
    if (lane < kLandmarkFp8Tail / 4) {
      reinterpret_cast<float*>(out + static_cast<int64_t>(S) * d)[lane] = lane == 0 ? scale : 0.0f;
    }
  } else {
    for (int s = 0; s < S; ++s) {
      float row[kPerLane];
      row_of(s, row);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int j = lane + 32 * i;
        if (j < d) out[static_cast<int64_t>(s) * d + j] = FromF32<L>(row[i]);
      }
    }
  }
  mm = WarpSum(mm);
  float lo = INFINITY;
  for (int t = 0; t < C; ++t) {
    float dot = 0.0f, kk = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int j = lane + 32 * i;
      if (j < d) {
        const float x = ToF32<T>(keys[static_cast<int64_t>(t) * d + j]);
        dot += mean[i] * x;
        kk += x * x;
      }
    }
    dot = WarpSum(dot);
    kk = WarpSum(kk);
    const float cs = Cosine(dot, mm, kk);
    lo = (isnan(cs) || isnan(lo)) ? NAN : fminf(lo, cs);
  }
  if (lane == 0) a.min_cos[p * a.min_cos_batch_stride + h * a.min_cos_head_stride + c] = lo;
}

// Order-preserving map of a float to uint32: NaN -> 0 (lowest), -0 == +0.
__device__ __forceinline__ uint32_t OrderKey(float x) {
  if (isnan(x)) return 0u;
  if (x == 0.0f) x = 0.0f;
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

constexpr int kSelectThreads = 1024;

__global__ void __launch_bounds__(kSelectThreads) SelectOutliersKernel(SelectOutliersArgs a) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_need;
  const int h = blockIdx.x;
  const int n = a.n_chunks, O = a.num_outliers;
  const float* s = a.min_cos + h * a.min_cos_head_stride;
  int32_t* out = a.out + static_cast<int64_t>(h) * O;
  if (O <= 0) return;

  // Radix select, most significant byte first: find T = the O-th smallest key
  // and how many keys equal to T to take (need).
  uint32_t prefix = 0, mask = 0;
  int need = O;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const uint32_t key = OrderKey(s[i]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int cum = 0, b = 0;
      for (; b < 255; ++b) {
        if (cum + hist[b] >= need) break;
        cum += hist[b];
      }
      s_prefix = prefix | (static_cast<uint32_t>(b) << shift);
      s_need = need - cum;
    }
    __syncthreads();
    prefix = s_prefix;
    need = s_need;
    mask |= 255u << shift;
    __syncthreads();
  }
  const uint32_t T = prefix;

  // Emit in index order: all keys < T, and the first `need` keys == T.
  int eq_carry = 0, out_carry = 0;
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const uint32_t key = i < n ? OrderKey(s[i]) : 0xffffffffu;
    const int is_eq = (i < n && key == T) ? 1 : 0;
    int eq_rank, eq_total;
    Scan(scan_tmp).ExclusiveSum(is_eq, eq_rank, eq_total);
    __syncthreads();
    const int take = (i < n && (key < T || (is_eq && eq_carry + eq_rank < need))) ? 1 : 0;
    int pos, taken;
    Scan(scan_tmp).ExclusiveSum(take, pos, taken);
    __syncthreads();
    if (take) out[out_carry + pos] = i;
    eq_carry += eq_total;
    out_carry += taken;
    if (out_carry >= O) break;  // uniform across the block
  }
}

__global__ void OutlierMaskKernel(GatherOutliersArgs a) {
  const int h = blockIdx.x;
  uint8_t* mask = a.excluded + h * a.mask_head_stride;
  for (int c = threadIdx.x; c < a.n_chunks; c += blockDim.x) mask[c] = 0;
  __syncthreads();
  for (int j = threadIdx.x; j < a.num_outliers; j += blockDim.x)
    mask[a.outliers[static_cast<int64_t>(h) * a.num_outliers + j]] = 1;
}

template <typename T>
__global__ void GatherOutliersKernel(GatherOutliersArgs a) {
  const int j = blockIdx.x, h = blockIdx.y;
  const int c = a.outliers[static_cast<int64_t>(h) * a.num_outliers + j];
  const int64_t row = static_cast<int64_t>(a.chunk_tokens) * a.d;
  const int64_t src = h * a.kv_head_stride + (a.first_token + static_cast<int64_t>(c) * a.chunk_tokens) * a.d;
  const int64_t dst = h * a.att_head_stride + j * row;
  const T* k = static_cast<const T*>(a.k) + src;
  const T* v = static_cast<const T*>(a.v) + src;
  T* ak = static_cast<T*>(a.att_k) + dst;
  T* av = static_cast<T*>(a.att_v) + dst;
  for (int64_t e = threadIdx.x; e < row; e += blockDim.x) {
    ak[e] = k[e];
    av[e] = v[e];
  }
}

}  // namespace

void LaunchChunkLandmarks(const ChunkLandmarksArgs& a, cudaStream_t stream) {
  const int64_t warps = static_cast<int64_t>(a.hkv) * a.n_chunks * a.batch;
  if (warps <= 0) return;
  CHECK(a.d >= 1 && a.d <= kMaxHeadDim) << "ChunkLandmarks: head_dim " << a.d << " > " << kMaxHeadDim;
  CHECK(a.landmarks_per_chunk >= 1 && a.chunk_tokens % a.landmarks_per_chunk == 0)
      << "ChunkLandmarks: " << a.landmarks_per_chunk << " landmarks per chunk of " << a.chunk_tokens;
  const int threads = 256;
  const int blocks = static_cast<int>((warps + threads / 32 - 1) / (threads / 32));
  const bool kb = a.kv_dtype == DType::kBF16, lb = a.landmark_dtype == DType::kBF16;
  if (a.landmark_fp8) {
    CHECK(a.d % 8 == 0) << "ChunkLandmarks: fp8 landmarks need head_dim a multiple of 8, got " << a.d;
    if (kb)
      ChunkLandmarksKernel<__nv_bfloat16, uint8_t><<<blocks, threads, 0, stream>>>(a);
    else
      ChunkLandmarksKernel<float, uint8_t><<<blocks, threads, 0, stream>>>(a);
    return;
  }
  if (kb && lb) ChunkLandmarksKernel<__nv_bfloat16, __nv_bfloat16><<<blocks, threads, 0, stream>>>(a);
  if (kb && !lb) ChunkLandmarksKernel<__nv_bfloat16, float><<<blocks, threads, 0, stream>>>(a);
  if (!kb && lb) ChunkLandmarksKernel<float, __nv_bfloat16><<<blocks, threads, 0, stream>>>(a);
  if (!kb && !lb) ChunkLandmarksKernel<float, float><<<blocks, threads, 0, stream>>>(a);
}

void LaunchSelectOutlierChunks(const SelectOutliersArgs& a, cudaStream_t stream) {
  if (a.hkv <= 0 || a.num_outliers <= 0) return;
  CHECK_LE(a.num_outliers, a.n_chunks) << "SelectOutlierChunks: more outliers than chunks";
  SelectOutliersKernel<<<a.hkv, kSelectThreads, 0, stream>>>(a);
}

void LaunchGatherOutliers(const GatherOutliersArgs& a, cudaStream_t stream) {
  if (a.hkv <= 0) return;
  OutlierMaskKernel<<<a.hkv, 256, 0, stream>>>(a);
  if (a.num_outliers <= 0) return;
  const dim3 grid(a.num_outliers, a.hkv);
  PENUMBRA_DISPATCH_FLOAT(a.kv_dtype, T, GatherOutliersKernel<T><<<grid, 256, 0, stream>>>(a));
}

}  // namespace penumbra::kernels
