// CPU reference of the low-rank factorization of pre-RoPE keys (see
// kernels/lowrank.cuh for the contract): f32 throughout, Gram matrix with
// cblas_ssyrk, eigendecomposition with LAPACKE_ssyevd.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace penumbra::kernels::cpu {

struct LowRankArgs {
  const float* keys = nullptr;  // [S, hkv*d] pre-RoPE keys, row t = token t's keys of all KV heads
  int64_t S = 0;
  int hkv = 0, d = 0;
  int rank = 0;                // 1 <= rank <= hkv*d
  float* a_out = nullptr;      // [S, rank]: U_r
  float* b_out = nullptr;      // [hkv][rank][d]: Sigma_r V_r^T, columns of head h
  float* proj_out = nullptr;   // [hkv*d, rank]: V_r Sigma_r^{-1} (new keys k' map to k' P)
  float* sigma_out = nullptr;  // [rank] singular values, descending; may be null
};

// Returns Internal when the eigensolver fails, InvalidArgument on bad sizes.
Status LowRankFactor(const LowRankArgs& a);

// a_out[i] = k[i] * P for n rows: [n, D] x [D, rank] -> [n, rank].
void ProjectKeys(const float* k, int n, int D, int rank, const float* proj, float* a_out);

}  // namespace penumbra::kernels::cpu
