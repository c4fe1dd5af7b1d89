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

#include "common/status.h"
#include "kernels/lowrank_args.h"  // LowRankArgs, ProjectKeysArgs

namespace penumbra::kernels {

// Bytes of workspace LowRankFactor needs for these sizes (asks cuSOLVER for its
// eigensolver buffer size, hence the handle).
Result<size_t> LowRankWorkspaceBytes(cusolverDnHandle_t solver, int64_t S, int D, int rank);

// Enqueues the factorization on `stream` (sets both handles' stream to it and
// leaves them so). Does not allocate or synchronize, except that it reads
// cuSOLVER's info word back to the host, which waits for the eigensolver:
// info != 0 -> Internal. InvalidArgument on bad sizes or a short workspace.
Status LowRankFactor(const LowRankArgs& args, cublasHandle_t blas, cusolverDnHandle_t solver, cudaStream_t stream);

// A-rows of new tokens (ProjectKeysArgs: a_out[i] = k[i] * P).
void LaunchProjectKeys(const ProjectKeysArgs& args, cudaStream_t stream);

}  // namespace penumbra::kernels
