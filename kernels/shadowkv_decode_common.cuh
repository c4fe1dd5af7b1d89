// Device helpers shared by the ShadowKV decode kernels (shadowkv_score.cu,
// shadowkv_query_scores.cu, shadowkv_rebuild_k.cu, shadowkv_fetch_v.cu,
// shadowkv_slot_update.cu): raw 8-element vector loads (bf16, f32, e4m3
// landmark codes) and a sequence's landmark rows (LandmarkRows). Internal to
// those files (an anonymous namespace: each includes its own copy).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>

#include "kernels/common.cuh"
#include "kernels/landmark_format.h"
#include "kernels/mma.cuh"
#include "kernels/shadowkv_decode.cuh"

namespace penumbra::kernels {
namespace {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float NegInf() { return __int_as_float(0xff800000); }

// A workspace part's size rounded up to 256 bytes (the next part's alignment).
inline size_t AlignUp(size_t x) { return (x + 255) & ~static_cast<size_t>(255); }

// 8 consecutive elements loaded with 16-byte loads, kept raw until used so that
// several loads can be in flight.
template <typename T>
struct Raw8;
template <>
struct Raw8<bf16> {
  uint4 v;
  __device__ __forceinline__ void Load(const bf16* p) { v = __ldg(reinterpret_cast<const uint4*>(p)); }
  __device__ __forceinline__ void Zero() { v = make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ void ToF32(float (&x)[8]) const {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[2 * j] = __uint_as_float(w[j] << 16);
      x[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  }
};
template <>
struct Raw8<float> {
  float4 lo, hi;
  __device__ __forceinline__ void Load(const float* p) {
    lo = __ldg(reinterpret_cast<const float4*>(p));
    hi = __ldg(reinterpret_cast<const float4*>(p + 4));
  }
  __device__ __forceinline__ void Zero() { lo = hi = make_float4(0.f, 0.f, 0.f, 0.f); }
  __device__ __forceinline__ void ToF32(float (&x)[8]) const {
    x[0] = lo.x;
    x[1] = lo.y;
    x[2] = lo.z;
    x[3] = lo.w;
    x[4] = hi.x;
    x[5] = hi.y;
    x[6] = hi.z;
    x[7] = hi.w;
  }
};

// The landmark type of fp8 records (kernels/landmark_format.h): e4m3 codes.
struct Fp8 {};
template <typename T>
struct LandmarkElem {
  using type = T;
};
template <>
struct LandmarkElem<Fp8> {
  using type = uint8_t;
};

// An e4m3 code's value times 2^-120, exactly, by moving its fields into an
// f32's (a normal code's exponent field e, biased by 7, becomes an f32 field
// of e with bias 127; a subnormal code becomes an f32 subnormal): a shift and
// two masks instead of a conversion. Callers multiply by 2^120 once per
// row, folded into the record's scale (LandmarkRows::RowScale).
__device__ __forceinline__ float E4M3Raw(uint32_t b) {
  return __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20));
}
template <>
struct Raw8<Fp8> {
  uint2 v;
  __device__ __forceinline__ void Load(const uint8_t* p) { v = __ldg(reinterpret_cast<const uint2*>(p)); }
  __device__ __forceinline__ void Zero() { v = make_uint2(0, 0); }
  __device__ __forceinline__ void ToF32(float (&x)[8]) const {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[j] = E4M3Raw((v.x >> (8 * j)) & 0xffu);
      x[4 + j] = E4M3Raw((v.y >> (8 * j)) & 0xffu);
    }
  }
};
constexpr float kE4M3RawScale = 0x1p120f;  // undoes E4M3Raw's (and E4M3PairToBf16's) 2^-120

// Landmark row v of head h of sequence b (chunk v / landmarks_per_chunk):
// below the attached prefix's chunks from its landmarks (shared by its
// sequences), else from the sequence's own. Chunk records as in
// landmark_format.h (T = Fp8: e4m3 codes and a scale per record).
template <typename T>
struct LandmarkRows {
  using E = typename LandmarkElem<T>::type;
  static constexpr bool kFp8 = std::is_same_v<T, Fp8>;
  const E* shared;
  const E* own;
  int shared_chunks, d, shift, per_chunk;
  int64_t rec;  // elements per chunk record
  // row_shift: log2(landmarks_per_chunk) (ScoreWorkspace::shift).
  __device__ LandmarkRows(const ShadowkvScoreArgs& a, int b, int h, int row_shift)
      : shared_chunks(a.shared_chunks),
        d(a.d),
        shift(row_shift),
        per_chunk(a.landmarks_per_chunk),
        rec(LandmarkChunkElems(a.landmarks_per_chunk, a.d, kFp8)) {
    const int64_t cap = a.landmark_cap > 0 ? a.landmark_cap : a.chunk_cap;
    own = static_cast<const E*>(a.landmarks[b]) + h * cap * rec;
    shared = shared_chunks > 0 ? static_cast<const E*>(a.shared_landmarks[b]) + h * shared_chunks * rec : own;
  }
  __device__ const E* Record(int chunk) const {
    return chunk < shared_chunks ? shared + chunk * rec : own + (chunk - shared_chunks) * rec;
  }
  __device__ const E* Row(int v) const { return Record(v >> shift) + static_cast<int64_t>(v & (per_chunk - 1)) * d; }
  // What row v's products with its raw elements (Raw8::ToF32,
  // E4M3PairToBf16) are multiplied by: 1, or the record's scale * 2^120.
  __device__ float RowScale(int v) const {
    if constexpr (kFp8) {
      return __ldg(reinterpret_cast<const float*>(Record(v >> shift) + static_cast<int64_t>(per_chunk) * d)) *
             kE4M3RawScale;
    } else {
      return 1.0f;
    }
  }
};

// A warp's 32 landmark rows from `base` (rows at or past `end` are zeros) as
// the B fragments of four n-tiles of 8 rows (mma.cuh's permuted layout: with
// Q from LoadPermutedQ, or LoadPermutedQForFp8K for fp8 rows); r = lane / 4,
// c = lane % 4.
template <int D, bool F8, typename Rows>
__device__ __forceinline__ void LoadLandmarkFragments(const Rows& land, int base, int end, int r, int c,
                                                      uint4 (&kr)[4][D / 32]) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int row = base + 8 * nt + r;
    if constexpr (F8)
      LoadPermutedKFp8<D>(land.Row(min(row, end - 1)), row < end, c, kr[nt]);
    else
      LoadPermutedK<D>(land.Row(min(row, end - 1)), row < end, c, kr[nt]);
  }
}

// 2^x by the special-function unit (ex2.approx.ftz: relative error ~2^-22;
// 2^-inf = 0).
__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The (max, sum of base^(x - max)) of a lane's 8 values over the four lanes
// of an MMA row (lanes 4 r .. 4 r + 3, the columns of one query row); base e,
// or 2 with kBase2 (values already scaled by log2 e). (-inf, 0) when every
// value is -inf.
template <bool kBase2>
__device__ __forceinline__ float2 RowQuadStats(const float (&x)[4][2]) {
  float m = NegInf();
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) m = fmaxf(m, fmaxf(x[nt][0], x[nt][1]));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
  float sum = 0.0f;
  if (m != NegInf()) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) sum += kBase2 ? Ex2(x[nt][e] - m) : expf(x[nt][e] - m);
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  return make_float2(m, sum);
}

// One warp's log-sum-exp (base e, or 2 with kBase2) of n partial (max, sum)
// pairs, every lane the same; -inf when none counts.
template <bool kBase2>
__device__ __forceinline__ float WarpPartsLse(const float2* p, int n, int lane) {
  float m = NegInf();
  for (int t = lane; t < n; t += 32) m = fmaxf(m, p[t].x);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float sum = 0.0f;
  if (m != NegInf()) {
    for (int t = lane; t < n; t += 32)
      if (p[t].x != NegInf()) sum += p[t].y * (kBase2 ? Ex2(p[t].x - m) : expf(p[t].x - m));
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (m == NegInf() || !(sum > 0.0f)) return NegInf();
  return m + (kBase2 ? log2f(sum) : logf(sum));
}

}  // namespace
}  // namespace penumbra::kernels
