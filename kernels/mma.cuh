// Tensor-core and async-copy helpers shared by the attention and ShadowKV
// kernels (sm_80+ instructions: mma.sync, ldmatrix, cp.async). Header-only;
// included by .cu files only.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace penumbra::kernels {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; src_bytes = 0 zero-fills.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a (16x16, row) * b (16x8, col); bf16 in, f32 accumulate. Registers
// only (not volatile), so the compiler may schedule it freely.
// Fragments (lane = 4 * r + c): a0 = A[r][2c..2c+1], a1 = A[r+8][2c..],
// a2 = A[r][2c+8..], a3 = A[r+8][2c+8..]; b0 = B[2c..2c+1][r], b1 = B[2c+8..][r];
// c0,c1 = C[r][2c..2c+1], c2,c3 = C[r+8][2c..2c+1]. Pairs: low half first.
__device__ __forceinline__ void MmaBf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  MmaBf16(c, a[0], a[1], a[2], a[3], b0, b1);
}
__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  MmaBf16(c, a[0], a[1], a[2], a[3], b[0], b[1]);
}

// Two floats as a bf16 pair (lo in the low half).
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ---- Q.K^T for a few query rows, fragments straight from global memory ----
// Used by decode attention and ShadowKV scoring: S [16 x 8n] = Q [16 x D] . K^T
// with up to 8 query rows r (rows r + 8 zero). The head dimension is permuted
// so that every fragment is one 16-byte load (a dot product does not care
// about the order of its terms, as long as q and k use the same one): lane
// (r = lane/4, c = lane%4) loads 16 bytes at dims 32j + 8c (j < D/32) of Q row
// r and of key row r of each n-tile; k-step 2j + h covers dims
// 32j + 8c + 4h + {0,1} (k = 2c, 2c+1) and + {2,3} (k = 2c+8, 2c+9).

// Q's A fragments {a0, a2} per k-step from `row` (D bf16); zeros if !valid.
template <int D>
__device__ __forceinline__ void LoadPermutedQ(const __nv_bfloat16* row, bool valid, int c, uint32_t (&qa)[D / 16][2]) {
#pragma unroll
  for (int j = 0; j < D / 32; ++j) {
    const uint4 u = valid ? __ldg(reinterpret_cast<const uint4*>(row + 32 * j + 8 * c)) : make_uint4(0, 0, 0, 0);
    qa[2 * j][0] = u.x;
    qa[2 * j][1] = u.y;
    qa[2 * j + 1][0] = u.z;
    qa[2 * j + 1][1] = u.w;
  }
}

// One key row's B fragments (this lane's D/8 elements of `row`); zeros if !valid.
template <int D>
__device__ __forceinline__ void LoadPermutedK(const __nv_bfloat16* row, bool valid, int c, uint4 (&k)[D / 32]) {
#pragma unroll
  for (int j = 0; j < D / 32; ++j)
    k[j] = valid ? __ldg(reinterpret_cast<const uint4*>(row + 32 * j + 8 * c)) : make_uint4(0, 0, 0, 0);
}

// fp8 (e4m3) key rows (ShadowKV's fp8 landmarks): a lane's D/8 elements come
// from 16-byte loads of 16 codes (row + 64 j + 16 c), so Q's fragments take
// its elements in the matching order: k-step pair j holds elements 64 (j/2) +
// 16 c + 8 (j%2) ..
template <int D>
__device__ __forceinline__ void LoadPermutedQForFp8K(const __nv_bfloat16* row, bool valid, int c,
                                                     uint32_t (&qa)[D / 16][2]) {
  static_assert(D % 64 == 0, "fp8 rows are loaded 64 codes per step of the four lanes");
#pragma unroll
  for (int j = 0; j < D / 32; ++j) {
    const __nv_bfloat16* p = row + 64 * (j >> 1) + 16 * c + 8 * (j & 1);
    const uint4 u = valid ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
    qa[2 * j][0] = u.x;
    qa[2 * j][1] = u.y;
    qa[2 * j + 1][0] = u.z;
    qa[2 * j + 1][1] = u.w;
  }
}

// Codes 2i, 2i+1 of w (i = 0: bytes 0, 1; i = 1: bytes 2, 3) as a bf16 pair
// whose values are the codes' times 2^-120, exactly: the sign to bit 15, the
// exponent and mantissa fields below it (bf16 has e4m3's 3 mantissa bits and
// more; a bias of 127 instead of 7 is the 2^-120).
__device__ __forceinline__ uint32_t E4M3PairToBf16(uint32_t w, int i) {
  const uint32_t t = __byte_perm(w, 0u, i == 0 ? 0x1404u : 0x3424u);  // codes to bytes 1 and 3
  return (t & 0x80008000u) | ((t >> 4) & 0x07f007f0u);
}

// One fp8 key row's B fragments for MmaPermutedQK (with Q from
// LoadPermutedQForFp8K); the products come out 2^-120 times the codes'.
template <int D>
__device__ __forceinline__ void LoadPermutedKFp8(const uint8_t* row, bool valid, int c, uint4 (&k)[D / 32]) {
#pragma unroll
  for (int j = 0; j < D / 64; ++j) {
    const uint4 u = valid ? __ldg(reinterpret_cast<const uint4*>(row + 64 * j + 16 * c)) : make_uint4(0, 0, 0, 0);
    k[2 * j] =
        make_uint4(E4M3PairToBf16(u.x, 0), E4M3PairToBf16(u.x, 1), E4M3PairToBf16(u.y, 0), E4M3PairToBf16(u.y, 1));
    k[2 * j + 1] =
        make_uint4(E4M3PairToBf16(u.z, 0), E4M3PairToBf16(u.z, 1), E4M3PairToBf16(u.w, 0), E4M3PairToBf16(u.w, 1));
  }
}

// acc (one n-tile of 8 keys) += Q . K^T over all D/16 k-steps.
template <int D>
__device__ __forceinline__ void MmaPermutedQK(float (&acc)[4], const uint32_t (&qa)[D / 16][2],
                                              const uint4 (&k)[D / 32]) {
#pragma unroll
  for (int j = 0; j < D / 32; ++j) {
    MmaBf16(acc, qa[2 * j][0], 0u, qa[2 * j][1], 0u, k[j].x, k[j].y);
    MmaBf16(acc, qa[2 * j + 1][0], 0u, qa[2 * j + 1][1], 0u, k[j].z, k[j].w);
  }
}

// The same with all 16 rows of the m16n8k16 tile used: query rows g (qa) and
// g + 8 (qb), each loaded as LoadPermutedQ / LoadPermutedQForFp8K loads one;
// acc[0..1] are row g's products with this lane's two keys, acc[2..3] row g + 8's.
template <int D>
__device__ __forceinline__ void MmaPermutedQK16(float (&acc)[4], const uint32_t (&qa)[D / 16][2],
                                                const uint32_t (&qb)[D / 16][2], const uint4 (&k)[D / 32]) {
#pragma unroll
  for (int j = 0; j < D / 32; ++j) {
    MmaBf16(acc, qa[2 * j][0], qb[2 * j][0], qa[2 * j][1], qb[2 * j][1], k[j].x, k[j].y);
    MmaBf16(acc, qa[2 * j + 1][0], qb[2 * j + 1][0], qa[2 * j + 1][1], qb[2 * j + 1][1], k[j].z, k[j].w);
  }
}

}  // namespace penumbra::kernels
