// Low-rank factorization of one segment's pre-RoPE keys for one layer
// (ShadowKV, paper section 3 and Algorithm 1), and projection of new keys onto
// the same basis (paper appendix A.1, "ShadowKV+").
//
// K [S, D] (D = hkv*d; row t = token t's pre-RoPE keys of all KV heads) has the
// thin SVD K = U Sigma V^T. We keep rank r:
//   A = U_r            [S, r]       (shared by all KV heads)
//   B = Sigma_r V_r^T  [r, D]       stored per head as [hkv][r][d]
//   P = V_r Sigma_r^-1 [D, r] f32   (a new key k' maps to the A-row k' P)
// so K ~= A B, exact up to rounding when r = D.
//
// Algorithm: Gram matrix G = K^T K in fp32 (cublasGemmEx, CUBLAS_COMPUTE_32F,
// the handle's math mode forced to CUBLAS_DEFAULT_MATH for the call: no TF32),
// eigendecomposition of G (cusolverDnSsyevd, divide and conquer), top-r
// eigenpairs, sigma = sqrt(max(lambda, 0)). Components with sigma < 1e-6 *
// sigma_0 (numerically zero) get zero columns in A and P and a zero row in B.
// Each eigenvector's sign is flipped so that its largest-magnitude component
// (lowest index on ties) is positive, so CPU and GPU factors are comparable.
// Then A = K P, computed in row tiles (bf16 keys are widened to f32 per tile).
//
// Cost: the Gram GEMM reads K once (S*D*2 flops*D); syevd is O(D^3) and
// independent of S (~10-30 ms for D = 1024 on an H100); A = K P reads K once.
// Workspace (LowRankWorkspaceBytes): G (D*D f32), eigenvalues, the syevd
// buffer, and one row tile of widened keys and f32 A rows.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include "common/dtype.h"
#include "common/status.h"

namespace penumbra::kernels {

struct LowRankArgs {
  const void* keys = nullptr;      // [S, D] device, row-major, contiguous
  DType key_dtype = DType::kF32;   // kF32 or kBF16
  int64_t S = 0;                   // tokens, >= 1 (and < 2^31)
  int hkv = 0, d = 0;              // D = hkv * d
  int rank = 0;                    // 1 <= rank <= D
  void* a_out = nullptr;           // [S, rank] of factor_dtype
  void* b_out = nullptr;           // [hkv][rank][d] of factor_dtype
  DType factor_dtype = DType::kBF16;  // kBF16 or kF32
  float* proj_out = nullptr;       // [D, rank] f32
  float* sigma_out = nullptr;      // [rank] f32 singular values, descending; may be null
  void* workspace = nullptr;       // LowRankWorkspaceBytes(...) bytes, 256-byte aligned
  size_t workspace_bytes = 0;
};

// Bytes of workspace LowRankFactor needs for these sizes (asks cuSOLVER for its
// eigensolver buffer size, hence the handle).
Result<size_t> LowRankWorkspaceBytes(cusolverDnHandle_t solver, int64_t S, int D, int rank);

// Enqueues the factorization on `stream` (sets both handles' stream to it and
// leaves them so). Does not allocate or synchronize, except that it reads
// cuSOLVER's info word back to the host, which waits for the eigensolver:
// info != 0 -> Internal. InvalidArgument on bad sizes or a short workspace.
Status LowRankFactor(const LowRankArgs& args, cublasHandle_t blas, cusolverDnHandle_t solver, cudaStream_t stream);

// A-rows of new tokens: a_out[i] = k[i] * P, [n, D] x [D, rank] -> [n, rank].
// One block per (token, 128 outputs, problem); k row staged in shared memory (D <= 8192).
struct ProjectKeysArgs {
  const void* keys = nullptr;      // [n, D] device
  DType key_dtype = DType::kF32;   // kF32 or kBF16
  int n = 0, D = 0, rank = 0;
  const float* proj = nullptr;     // [D, rank] f32 (LowRankArgs::proj_out)
  void* a_out = nullptr;           // [n, rank] of out_dtype
  int64_t a_row_stride = 0;        // elements between rows of a_out; 0 = rank
  DType out_dtype = DType::kBF16;  // kF32 or kBF16
  // `batch` independent projections in one launch (e.g. every layer of a
  // sequence): problem i reads keys + i*keys_batch_stride and proj +
  // i*proj_batch_stride and writes a_out + i*a_batch_stride (elements).
  int batch = 1;
  int64_t keys_batch_stride = 0, proj_batch_stride = 0, a_batch_stride = 0;
};
void LaunchProjectKeys(const ProjectKeysArgs& args, cudaStream_t stream);

}  // namespace penumbra::kernels
