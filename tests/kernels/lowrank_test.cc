// CPU reference of the low-rank key factorization: exactness at full rank,
// Eckart-Young optimality at lower rank, projection of new keys, conventions.
#include "kernels/cpu/lowrank.h"

#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace penumbra::kernels::cpu {
namespace {

using penumbra::testing::AllClose;

struct Factors {
  std::vector<float> a, b, p, sigma;
};

Factors Factor(const std::vector<float>& k, int64_t S, int hkv, int d, int r) {
  Factors f;
  f.a.assign(S * r, NAN);
  f.b.assign(static_cast<size_t>(hkv) * r * d, NAN);
  f.p.assign(static_cast<size_t>(hkv) * d * r, NAN);
  f.sigma.assign(r, NAN);
  LowRankArgs args;
  args.keys = k.data();
  args.S = S;
  args.hkv = hkv;
  args.d = d;
  args.rank = r;
  args.a_out = f.a.data();
  args.b_out = f.b.data();
  args.proj_out = f.p.data();
  args.sigma_out = f.sigma.data();
  const Status st = LowRankFactor(args);
  EXPECT_TRUE(st.ok()) << st;
  return f;
}

// K_hat[t][h*d + j] = sum_i A[t][i] B[h][i][j], in double.
std::vector<float> Reconstruct(const Factors& f, int64_t S, int hkv, int d, int r) {
  const int D = hkv * d;
  std::vector<float> out(S * D);
  for (int64_t t = 0; t < S; ++t)
    for (int h = 0; h < hkv; ++h)
      for (int j = 0; j < d; ++j) {
        double acc = 0;
        for (int i = 0; i < r; ++i) acc += double(f.a[t * r + i]) * f.b[(static_cast<size_t>(h) * r + i) * d + j];
        out[t * D + h * d + j] = static_cast<float>(acc);
      }
  return out;
}

// Keys with a decaying spectrum, like real pre-RoPE keys: column j of a
// Gaussian matrix scaled by exp(-j / 12), then mixed by a random rotation-ish
// dense matrix so no column is special.
std::vector<float> DecayingKeys(int64_t S, int D, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01;
  std::vector<float> x(S * D), mix(static_cast<size_t>(D) * D), k(S * D, 0.0f);
  for (int64_t t = 0; t < S; ++t)
    for (int j = 0; j < D; ++j) x[t * D + j] = n01(rng) * std::exp(-j / 12.0f);
  for (auto& m : mix) m = n01(rng) / std::sqrt(float(D));
  for (int64_t t = 0; t < S; ++t)
    for (int i = 0; i < D; ++i) {
      const float xi = x[t * D + i];
      for (int j = 0; j < D; ++j) k[t * D + j] += xi * mix[static_cast<size_t>(i) * D + j];
    }
  return k;
}

std::vector<float> GaussianKeys(int64_t S, int D, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01;
  std::vector<float> k(S * D);
  for (auto& v : k) v = n01(rng);
  return k;
}

TEST(LowRankCpuTest, FullRankReproducesKeys) {
  struct Case {
    int64_t S;
    int hkv, d;
  };
  for (const Case c : {Case{1, 1, 64}, Case{7, 2, 64}, Case{129, 3, 64}, Case{300, 2, 128}, Case{600, 4, 64}}) {
    SCOPED_TRACE("S " + std::to_string(c.S) + " hkv " + std::to_string(c.hkv) + " d " + std::to_string(c.d));
    const int D = c.hkv * c.d;
    const auto k = GaussianKeys(c.S, D, 7 + c.S);
    const Factors f = Factor(k, c.S, c.hkv, c.d, D);
    const auto rec = Reconstruct(f, c.S, c.hkv, c.d, D);
    EXPECT_TRUE(AllClose(rec, k, 2e-4f, 2e-4f));
  }
}

TEST(LowRankCpuTest, TruncationErrorIsDiscardedSpectrum) {
  const int64_t S = 700;
  const int hkv = 2, d = 64, D = hkv * d;
  const auto k = DecayingKeys(S, D, 11);
  double total = 0;
  for (float v : k) total += double(v) * v;
  const Factors full = Factor(k, S, hkv, d, D);
  for (int r : {1, 5, 37, 100, D - 1}) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const Factors f = Factor(k, S, hkv, d, r);
    // Singular values agree with the full-rank run and descend.
    for (int i = 0; i < r; ++i) {
      EXPECT_NEAR(f.sigma[i], full.sigma[i], 1e-5f * full.sigma[0]) << i;
      if (i > 0) {
        EXPECT_LE(f.sigma[i], f.sigma[i - 1]);
      }
    }
    double kept = 0;
    for (int i = 0; i < r; ++i) kept += double(f.sigma[i]) * f.sigma[i];
    const double discarded = std::max(0.0, total - kept);
    const auto rec = Reconstruct(f, S, hkv, d, r);
    double err = 0;
    for (size_t i = 0; i < k.size(); ++i) err += (double(rec[i]) - k[i]) * (double(rec[i]) - k[i]);
    // Eckart-Young: the rank-r SVD error is exactly the discarded energy.
    EXPECT_NEAR(err, discarded, 2e-5 * total + 1e-3 * discarded) << "total " << total;
  }
}

TEST(LowRankCpuTest, ProjectionOfOwnRowsGivesA) {
  const int64_t S = 257;
  const int hkv = 2, d = 64, D = hkv * d, r = 40;
  const auto k = DecayingKeys(S, D, 5);
  const Factors f = Factor(k, S, hkv, d, r);
  std::vector<float> a(S * r);
  ProjectKeys(k.data(), static_cast<int>(S), D, r, f.p.data(), a.data());
  EXPECT_TRUE(AllClose(a, f.a, 1e-5f, 1e-4f));
  // Columns of A are orthonormal (A = U_r).
  for (int i = 0; i < r; ++i)
    for (int j = 0; j <= i; ++j) {
      double dot = 0;
      for (int64_t t = 0; t < S; ++t) dot += double(f.a[t * r + i]) * f.a[t * r + j];
      EXPECT_NEAR(dot, i == j ? 1.0 : 0.0, 2e-3) << i << "," << j;
    }
}

TEST(LowRankCpuTest, FullRankProjectionRebuildsNewKeys) {
  // ShadowKV+: a generated token's key k' is stored as k' P and rebuilt as
  // (k' P) B; at full rank that is k' itself.
  const int64_t S = 400;
  const int hkv = 1, d = 64, D = hkv * d;
  const auto k = GaussianKeys(S, D, 9);
  const Factors f = Factor(k, S, hkv, d, D);
  const int n = 8;
  const auto fresh = GaussianKeys(n, D, 99);
  Factors g;
  g.a.resize(n * D);
  g.b = f.b;
  ProjectKeys(fresh.data(), n, D, D, f.p.data(), g.a.data());
  EXPECT_TRUE(AllClose(Reconstruct(g, n, hkv, d, D), fresh, 2e-4f, 2e-4f));
}

TEST(LowRankCpuTest, SignConventionLargestComponentPositive) {
  const int64_t S = 129;
  const int hkv = 3, d = 64, D = hkv * d, r = 37;
  const auto k = DecayingKeys(S, D, 3);
  const Factors f = Factor(k, S, hkv, d, r);
  for (int i = 0; i < r; ++i) {
    float best = 0;
    for (int h = 0; h < hkv; ++h)
      for (int j = 0; j < d; ++j) {
        const float v = f.b[(static_cast<size_t>(h) * r + i) * d + j];
        if (std::fabs(v) > std::fabs(best)) best = v;
      }
    EXPECT_GT(best, 0.0f) << "component " << i;
  }
}

TEST(LowRankCpuTest, ZeroKeysGiveZeroFactors) {
  const int64_t S = 16;
  const int hkv = 1, d = 64, r = 8;
  std::vector<float> k(S * d, 0.0f);
  const Factors f = Factor(k, S, hkv, d, r);
  for (float v : f.a) EXPECT_EQ(v, 0.0f);
  for (float v : f.b) EXPECT_EQ(v, 0.0f);
  for (float v : f.p) EXPECT_EQ(v, 0.0f);
}

TEST(LowRankCpuTest, RejectsBadRank) {
  std::vector<float> k(64, 1.0f), out(64 * 65);
  LowRankArgs a;
  a.keys = k.data();
  a.S = 1;
  a.hkv = 1;
  a.d = 64;
  a.rank = 65;
  a.a_out = a.b_out = a.proj_out = out.data();
  EXPECT_EQ(LowRankFactor(a).code(), StatusCode::kInvalidArgument);
  a.rank = 0;
  EXPECT_EQ(LowRankFactor(a).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace penumbra::kernels::cpu
