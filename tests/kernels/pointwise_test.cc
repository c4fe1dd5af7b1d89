// CPU reference checks for the pointwise ops: hand-computed tiny cases and
// properties (RoPE is a rotation; sampling follows its distribution).
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cpu/ops.h"
#include "tests/test_util.h"

namespace penumbra::kernels::cpu {
namespace {

using ::penumbra::testing::AllClose;

TEST(EmbeddingTest, GathersRows) {
  const std::vector<float> table = {0, 1, 10, 11, 20, 21};  // vocab 3, dim 2
  const std::vector<int32_t> ids = {2, 0, 2};
  std::vector<float> out(6, -1.0f);
  Embedding(table.data(), ids.data(), 3, 2, out.data());
  EXPECT_TRUE(AllClose(out, {20, 21, 0, 1, 20, 21}, 0, 0));
}

TEST(RmsNormTest, HandComputed) {
  const std::vector<float> x = {1, 2, 3, 4, -2, 0, 0, 2};
  const std::vector<float> w = {1, 1, 2, 0.5f};
  std::vector<float> out(8);
  RmsNorm(x.data(), w.data(), 2, 4, 0.0f, out.data());
  const float r0 = 1.0f / std::sqrt(7.5f), r1 = 1.0f / std::sqrt(2.0f);
  EXPECT_TRUE(AllClose(out, {r0, 2 * r0, 6 * r0, 2 * r0, -2 * r1, 0, 0, r1}, 0, 1e-6f));
  // eps enters inside the square root.
  RmsNorm(x.data(), w.data(), 1, 4, 1.0f, out.data());
  EXPECT_NEAR(out[0], 1.0f / std::sqrt(8.5f), 1e-6f);
}

TEST(RopeTest, PositionZeroIsIdentity) {
  std::vector<float> x = {0.5f, -1, 2, 3, 1, 2, 3, 4};
  const std::vector<float> inv_freq = {1.0f, 0.1f};
  const std::vector<float> orig = x;
  ApplyRope(x.data(), 2, 4, 0, inv_freq.data());
  EXPECT_TRUE(AllClose(x, orig, 0, 0));
}

TEST(RopeTest, HandComputedRotateHalf) {
  // d = 4: pairs (0, 2) and (1, 3); angles pos * inv_freq.
  std::vector<float> x = {1, 2, 3, 4};
  const std::vector<float> inv_freq = {1.0f, 0.5f};
  ApplyRope(x.data(), 1, 4, 3, inv_freq.data());
  const float a0 = 3.0f, a1 = 1.5f;
  const std::vector<float> expect = {1 * std::cos(a0) - 3 * std::sin(a0), 2 * std::cos(a1) - 4 * std::sin(a1),
                                     3 * std::cos(a0) + 1 * std::sin(a0), 4 * std::cos(a1) + 2 * std::sin(a1)};
  EXPECT_TRUE(AllClose(x, expect, 1e-6f, 1e-6f));
}

TEST(RopeTest, PreservesPairNormsAndComposes) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  const int d = 64, half = d / 2;
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / d);
  std::vector<float> x(d);
  for (auto& v : x) v = u(rng);
  std::vector<float> y = x;
  ApplyRope(y.data(), 1, d, 12345, inv_freq.data());
  for (int i = 0; i < half; ++i) {
    EXPECT_NEAR(std::hypot(x[i], x[i + half]), std::hypot(y[i], y[i + half]), 1e-5f) << i;
  }
  // Rotation by 5 then by 7 equals rotation by 12 (angles are small and exact enough here).
  std::vector<float> a = x, b = x;
  ApplyRope(a.data(), 1, d, 5, inv_freq.data());
  ApplyRope(a.data(), 1, d, 7, inv_freq.data());
  ApplyRope(b.data(), 1, d, 12, inv_freq.data());
  EXPECT_TRUE(AllClose(a, b, 1e-5f, 1e-5f));
}

TEST(RopeStoreTest, ScattersQueriesKeysAndValues) {
  const int n = 2, hq = 2, hkv = 1, d = 4;
  const int row = (hq + 2 * hkv) * d;
  std::vector<float> qkv(n * row);
  for (int i = 0; i < n * row; ++i) qkv[i] = 0.25f * static_cast<float>(i + 1);
  const std::vector<int32_t> positions = {7, 0};
  const std::vector<float> inv_freq = {1.0f, 0.01f};
  const int64_t head_stride = 40;  // cache [hkv, 10 slots, d]
  std::vector<float> kc(head_stride * hkv, -9.0f), vc(head_stride * hkv, -9.0f);
  float* k_dst[] = {kc.data() + 3 * d, kc.data() + 8 * d};  // token 0 -> slot 3, token 1 -> slot 8
  float* v_dst[] = {vc.data() + 3 * d, vc.data() + 8 * d};
  std::vector<float> q(n * hq * d), pre(n * hkv * d);
  RopeStoreArgs a;
  a.qkv = qkv.data();
  a.positions = positions.data();
  a.inv_freq = inv_freq.data();
  a.n = n, a.hq = hq, a.hkv = hkv, a.d = d;
  a.q_out = q.data();
  a.k_dst = k_dst;
  a.v_dst = v_dst;
  a.head_stride = head_stride;
  a.pre_rope_k_out = pre.data();
  RopeStore(a);
  for (int t = 0; t < n; ++t) {
    std::vector<float> eq(qkv.begin() + t * row, qkv.begin() + t * row + hq * d);
    ApplyRope(eq.data(), hq, d, positions[t], inv_freq.data());
    EXPECT_TRUE(AllClose(q.data() + t * hq * d, eq.data(), hq * d, 0, 0)) << t;
    std::vector<float> ek(qkv.begin() + t * row + hq * d, qkv.begin() + t * row + (hq + hkv) * d);
    EXPECT_TRUE(AllClose(pre.data() + t * hkv * d, ek.data(), d, 0, 0)) << t;
    ApplyRope(ek.data(), hkv, d, positions[t], inv_freq.data());
    EXPECT_TRUE(AllClose(k_dst[t], ek.data(), d, 0, 0)) << t;
    EXPECT_TRUE(AllClose(v_dst[t], qkv.data() + t * row + (hq + hkv) * d, d, 0, 0)) << t;
  }
  // Position 0 leaves token 1's key unrotated.
  EXPECT_TRUE(AllClose(k_dst[1], qkv.data() + row + hq * d, d, 0, 0));
  // Other slots untouched.
  for (int s = 0; s < 10; ++s) {
    if (s == 3 || s == 8) continue;
    for (int j = 0; j < d; ++j) EXPECT_EQ(kc[s * d + j], -9.0f);
  }
}

TEST(SwiGLUTest, HandComputed) {
  const std::vector<float> gu = {0, 1, -2, 3, 2, 5};  // n 1, F 3: gate {0, 1, -2}, up {3, 2, 5}
  std::vector<float> out(3);
  SwiGLU(gu.data(), 1, 3, out.data());
  const float s1 = 1.0f / (1.0f + std::exp(-1.0f)), s2 = -2.0f / (1.0f + std::exp(2.0f));
  EXPECT_TRUE(AllClose(out, {0.0f, s1 * 2, s2 * 5}, 0, 1e-6f));
}

TEST(AddBiasTest, AddsPerColumn) {
  std::vector<float> x = {1, 2, 3, 4, 5, 6};
  const std::vector<float> b = {10, 20, 30};
  AddBias(x.data(), b.data(), 2, 3);
  EXPECT_TRUE(AllClose(x, {11, 22, 33, 14, 25, 36}, 0, 0));
}

SamplingRow Row(float t, int k, float p, float u) {
  SamplingRow r;
  r.temperature = t;
  r.top_k = k;
  r.top_p = p;
  r.uniform = u;
  return r;
}

int32_t Argmax(const std::vector<float>& v) {
  int32_t best = 0;
  for (int i = 1; i < static_cast<int>(v.size()); ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

TEST(SampleTest, GreedyTakesLowestIndexAmongMaxima) {
  const std::vector<float> l = {1, 5, 3, 5, -std::numeric_limits<float>::infinity()};
  EXPECT_EQ(Sample(l.data(), 5, Row(0, 0, 1, 0.9f)), 1);
  EXPECT_EQ(Sample(l.data(), 5, Row(-1, 3, 0.5f, 0.1f)), 1);
  const std::vector<float> all_neg_inf(3, -std::numeric_limits<float>::infinity());
  EXPECT_EQ(Sample(all_neg_inf.data(), 3, Row(0, 0, 1, 0)), 0);
}

TEST(SampleTest, TopKOneAndTinyTopPAreArgmax) {
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0, 3);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> l(1000);
    for (auto& v : l) v = g(rng);
    const int32_t am = Argmax(l);
    for (float u : {0.0f, 0.3f, 0.999f}) {
      EXPECT_EQ(Sample(l.data(), 1000, Row(1.0f, 1, 1.0f, u)), am);
      EXPECT_EQ(Sample(l.data(), 1000, Row(0.7f, 0, 1e-6f, u)), am);
      EXPECT_EQ(Sample(l.data(), 1000, Row(1.3f, 50, 0.0f, u)), am);
    }
  }
}

// Empirical frequencies over an even grid of uniforms match the probabilities.
std::vector<double> Frequencies(const std::vector<float>& l, SamplingRow r, int draws) {
  std::vector<double> f(l.size(), 0.0);
  for (int i = 0; i < draws; ++i) {
    r.uniform = (static_cast<float>(i) + 0.5f) / static_cast<float>(draws);
    f[Sample(l.data(), static_cast<int>(l.size()), r)] += 1.0 / draws;
  }
  return f;
}

TEST(SampleTest, DistributionMatchesSoftmax) {
  const std::vector<float> l = {std::log(0.1f), std::log(0.4f), std::log(0.2f), std::log(0.3f)};
  const auto f = Frequencies(l, Row(1.0f, 0, 1.0f, 0), 100000);
  EXPECT_NEAR(f[0], 0.1, 1e-4);
  EXPECT_NEAR(f[1], 0.4, 1e-4);
  EXPECT_NEAR(f[2], 0.2, 1e-4);
  EXPECT_NEAR(f[3], 0.3, 1e-4);
  // Temperature 2 flattens: p ~ sqrt(p).
  const auto f2 = Frequencies(l, Row(2.0f, 0, 1.0f, 0), 100000);
  const double z = std::sqrt(0.1) + std::sqrt(0.4) + std::sqrt(0.2) + std::sqrt(0.3);
  EXPECT_NEAR(f2[0], std::sqrt(0.1) / z, 1e-4);
  EXPECT_NEAR(f2[1], std::sqrt(0.4) / z, 1e-4);
}

TEST(SampleTest, TopKRenormalizesAndKeepsTies) {
  const std::vector<float> l = {std::log(0.1f), std::log(0.4f), std::log(0.2f), std::log(0.3f)};
  const auto f = Frequencies(l, Row(1.0f, 2, 1.0f, 0), 100000);
  EXPECT_EQ(f[0], 0.0);
  EXPECT_EQ(f[2], 0.0);
  EXPECT_NEAR(f[1], 0.4 / 0.7, 1e-4);
  EXPECT_NEAR(f[3], 0.3 / 0.7, 1e-4);
  // Ties at the k-th value are all kept: k = 2 keeps three tokens here.
  const std::vector<float> tied = {3, 2, 2, 1};
  const auto ft = Frequencies(tied, Row(1.0f, 2, 1.0f, 0), 100000);
  EXPECT_GT(ft[1], 0.0);
  EXPECT_GT(ft[2], 0.0);
  EXPECT_EQ(ft[3], 0.0);
}

TEST(SampleTest, TopPKeepsSmallestNucleus) {
  const std::vector<float> l = {std::log(0.05f), std::log(0.5f), std::log(0.15f), std::log(0.3f)};
  // Descending: 0.5, 0.3 (cum 0.8 >= 0.7) -> keep {1, 3}.
  const auto f = Frequencies(l, Row(1.0f, 0, 0.7f, 0), 100000);
  EXPECT_EQ(f[0], 0.0);
  EXPECT_EQ(f[2], 0.0);
  EXPECT_NEAR(f[1], 0.5 / 0.8, 1e-4);
  EXPECT_NEAR(f[3], 0.3 / 0.8, 1e-4);
  // 0.85 needs the third token too.
  const auto f3 = Frequencies(l, Row(1.0f, 0, 0.85f, 0), 100000);
  EXPECT_EQ(f3[0], 0.0);
  EXPECT_NEAR(f3[2], 0.15 / 0.95, 1e-4);
  // top_p is relative to the top-k-kept mass: k = 3 keeps 0.95 of the mass;
  // 0.8 of that (0.76) needs 0.5 + 0.3.
  const auto fk = Frequencies(l, Row(1.0f, 3, 0.8f, 0), 100000);
  EXPECT_EQ(fk[2], 0.0);
  EXPECT_NEAR(fk[1], 0.5 / 0.8, 1e-4);
}

TEST(SampleTest, MaskedLogitsAreNeverSampled) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const std::vector<float> l = {ninf, 0.0f, ninf, 0.0f, ninf};
  const auto f = Frequencies(l, Row(1.0f, 0, 1.0f, 0), 1000);
  EXPECT_NEAR(f[1], 0.5, 1e-9);
  EXPECT_NEAR(f[3], 0.5, 1e-9);
  EXPECT_EQ(Sample(l.data(), 5, Row(1.0f, 0, 1.0f, 0.0f)), 1);
  EXPECT_EQ(Sample(l.data(), 5, Row(1.0f, 0, 1.0f, 0.99999f)), 3);
}

}  // namespace
}  // namespace penumbra::kernels::cpu
