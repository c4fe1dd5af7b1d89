// Hopper warpgroup MMA (wgmma, sm_90a) helpers: shared-memory matrix
// descriptors for the 128-byte-swizzled layout, the fences and the
// instructions the prefill attention kernel uses. Header-only; included by
// .cu files only.
//
// Layout (bf16, 128-byte swizzle): a tile of R rows and C columns is stored as
// C/64 column blocks of R rows x 128 bytes; 16-byte chunk c (0..7) of row r of
// a block sits at r * 128 + ((c ^ (r % 8)) * 16). Every block starts on a
// 1024-byte boundary. As a K-major operand (rows = M or N, columns = K) the
// descriptor's stride byte offset (SBO) is 1024 (8 rows) and one k16 step
// advances the start address by 32 bytes inside a block. As an MN-major B
// operand (rows = K, columns = N) the leading byte offset (LBO) is the byte
// size of one column block (the next 64 columns of N) and SBO is 1024 (the
// next 8 rows of K); one k16 step advances the start by 16 rows (2048 bytes).
#pragma once
#include <cstdint>

namespace penumbra::kernels {

// Byte offset of 16-byte chunk `c` (0 .. C/8-1) of row `r` in a swizzled tile of `rows` rows.
__device__ __forceinline__ uint32_t Sw128Offset(int r, int c, int rows) {
  return static_cast<uint32_t>((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// Shared-memory matrix descriptor, 128-byte swizzle (layout type 1).
__device__ __forceinline__ uint64_t Sw128Desc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// Orders register accesses before the warpgroup's next wgmma.
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes shared memory written through the generic proxy (stores, cp.async)
// visible to the async proxy (wgmma operands); each writing thread, before the barrier.
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Keeps the compiler from moving accesses of accumulator registers across a
// wgmma issue or wait (the asm statements do not name them).
template <int N>
__device__ __forceinline__ void WgmmaFenceOperands(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
  }
}

// The instructions below are m64nNk16, bf16 in, f32 accumulate; scale_d = 0
// overwrites D, 1 accumulates. Accumulator layout (per warp w of the
// warpgroup, lane = 4 g + t): d[i][e] = D[16 w + g + 8 (e / 2)][8 i + 2 t + e % 2].
// Register A fragment for one k16 step (same as mma.sync m16n8k16):
// a0 = A[16 w + g][2 t..], a1 = A[16 w + g + 8][2 t..], a2 = A[16 w + g][2 t + 8..],
// a3 = A[16 w + g + 8][2 t + 8..], low column in the low half.

// Accumulator operands of an m64n128k16 instruction: d[16][4] as %0 .. %63.
#define PENUMBRA_WGMMA_D64_REGS                                                      \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define PENUMBRA_WGMMA_D64_OUT                                                                                        \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),            \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),        \
      "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),        \
      "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),        \
      "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),        \
      "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),      \
      "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), \
      "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
      "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), \
      "+f"(d[15][3])

// Accumulator operands of an m64n64k16 instruction: d[8][4] as %0 .. %31.
#define PENUMBRA_WGMMA_D32_REGS                                            \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PENUMBRA_WGMMA_D32_OUT                                                                                 \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),     \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
      "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
      "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
      "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])

// D[64x128] (+)= A[64x16] . B[16x128]; A and B K-major in shared memory.
__device__ __forceinline__ void WgmmaSS64x128(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" PENUMBRA_WGMMA_D64_REGS
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : PENUMBRA_WGMMA_D64_OUT
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64x128] (+)= A[64x16] (registers) . B[16x128]; B MN-major in shared memory.
__device__ __forceinline__ void WgmmaRS64x128T(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b,
                                               int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" PENUMBRA_WGMMA_D64_REGS
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : PENUMBRA_WGMMA_D64_OUT
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// D[64x64] (+)= A[64x16] (registers) . B[16x64]; B MN-major in shared memory.
__device__ __forceinline__ void WgmmaRS64x64T(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" PENUMBRA_WGMMA_D32_REGS
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : PENUMBRA_WGMMA_D32_OUT
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

#undef PENUMBRA_WGMMA_D64_REGS
#undef PENUMBRA_WGMMA_D64_OUT
#undef PENUMBRA_WGMMA_D32_REGS
#undef PENUMBRA_WGMMA_D32_OUT

}  // namespace penumbra::kernels
