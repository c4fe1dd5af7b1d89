#include "kernels/cpu/lowrank.h"

#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace penumbra::kernels::cpu {

Status LowRankFactor(const LowRankArgs& a) {
  const int D = a.hkv * a.d;
  if (a.S < 1 || a.hkv < 1 || a.d < 1 || a.rank < 1 || a.rank > D)
    return Status::InvalidArgument("LowRankFactor: S " + std::to_string(a.S) + ", D " + std::to_string(D) + ", rank " +
                                   std::to_string(a.rank));
  const int r = a.rank;
  // G = K^T K (upper triangle), eigenvalues ascending, eigenvectors in columns.
  std::vector<float> g(static_cast<size_t>(D) * D, 0.0f);
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, D, static_cast<int>(a.S), 1.0f, a.keys, D, 0.0f, g.data(), D);
  std::vector<float> w(D);
  const lapack_int info = LAPACKE_ssyevd(LAPACK_ROW_MAJOR, 'V', 'U', D, g.data(), D, w.data());
  if (info != 0) return Status::Internal("LAPACKE_ssyevd failed, info " + std::to_string(info));

  const float sigma0 = std::sqrt(std::max(w[D - 1], 0.0f));
  const std::vector<float>& vecs = g;  // column j = eigenvector of w[j]
  std::vector<float> proj(static_cast<size_t>(D) * r);
  for (int i = 0; i < r; ++i) {
    const int col = D - 1 - i;
    const float sigma = std::sqrt(std::max(w[col], 0.0f));
    // Sign: the largest-magnitude component (lowest index on ties) is positive.
    int arg = 0;
    float best = -1.0f;
    for (int k = 0; k < D; ++k) {
      const float m = std::fabs(vecs[static_cast<size_t>(k) * D + col]);
      if (m > best) best = m, arg = k;
    }
    const float sign = vecs[static_cast<size_t>(arg) * D + col] < 0.0f ? -1.0f : 1.0f;
    const bool zero = !(sigma > 0.0f) || sigma < 1e-6f * sigma0;
    const float inv = zero ? 0.0f : sign / sigma;
    const float scale = zero ? 0.0f : sign * sigma;
    for (int k = 0; k < D; ++k) {
      const float v = vecs[static_cast<size_t>(k) * D + col];
      proj[static_cast<size_t>(k) * r + i] = v * inv;
      const int h = k / a.d, j = k % a.d;
      a.b_out[(static_cast<size_t>(h) * r + i) * a.d + j] = v * scale;
    }
    if (a.sigma_out) a.sigma_out[i] = sigma;
  }
  // A = K P.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(a.S), r, D, 1.0f, a.keys, D, proj.data(), r,
              0.0f, a.a_out, r);
  std::copy(proj.begin(), proj.end(), a.proj_out);
  return Status::OK();
}

void ProjectKeys(const float* k, int n, int D, int rank, const float* proj, float* a_out) {
  if (n <= 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, rank, D, 1.0f, k, D, proj, rank, 0.0f, a_out, rank);
}

}  // namespace penumbra::kernels::cpu
