// CPU reference of the ShadowKV prefill ops against naive double-precision
// formulas and std::sort.
#include "kernels/cpu/shadowkv_prefill.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace penumbra::kernels::cpu {
namespace {

using penumbra::testing::AllClose;

TEST(ShadowKvPrefillCpuTest, LandmarksAndMinCosMatchNaive) {
  struct Case {
    int hkv, d, C, n_chunks;
    int64_t first_token;
  };
  for (const Case c : {Case{1, 64, 8, 1, 0}, Case{2, 64, 8, 7, 16}, Case{3, 128, 16, 129, 8}, Case{8, 64, 16, 33, 0}}) {
    SCOPED_TRACE("hkv " + std::to_string(c.hkv) + " d " + std::to_string(c.d) + " C " + std::to_string(c.C) +
                 " chunks " + std::to_string(c.n_chunks));
    const int64_t cap_tokens = c.first_token + int64_t(c.n_chunks) * c.C + 5;
    const int64_t k_stride = cap_tokens * c.d;
    std::mt19937_64 rng(c.n_chunks);
    std::normal_distribution<float> n01;
    std::vector<float> k(c.hkv * k_stride);
    for (auto& v : k) v = n01(rng) + 0.5f;
    const int64_t l_stride = int64_t(c.n_chunks + 3) * c.d, m_stride = c.n_chunks + 2;
    std::vector<float> lm(c.hkv * l_stride, -7.0f), mc(c.hkv * m_stride, -7.0f);
    ChunkLandmarksArgs a;
    a.k = k.data();
    a.k_head_stride = k_stride;
    a.first_token = c.first_token;
    a.n_chunks = c.n_chunks;
    a.chunk_tokens = c.C;
    a.hkv = c.hkv;
    a.d = c.d;
    a.landmarks = lm.data();
    a.landmark_head_stride = l_stride;
    a.min_cos = mc.data();
    a.min_cos_head_stride = m_stride;
    ChunkLandmarks(a);

    std::vector<float> want_lm(lm), want_mc(mc);
    for (int h = 0; h < c.hkv; ++h)
      for (int ch = 0; ch < c.n_chunks; ++ch) {
        const float* keys = k.data() + h * k_stride + (c.first_token + int64_t(ch) * c.C) * c.d;
        std::vector<double> mean(c.d, 0.0);
        for (int t = 0; t < c.C; ++t)
          for (int j = 0; j < c.d; ++j) mean[j] += keys[t * c.d + j] / double(c.C);
        double mm = 0, lo = 2;
        for (int j = 0; j < c.d; ++j) mm += mean[j] * mean[j];
        for (int t = 0; t < c.C; ++t) {
          double dot = 0, kk = 0;
          for (int j = 0; j < c.d; ++j)
            dot += mean[j] * keys[t * c.d + j], kk += double(keys[t * c.d + j]) * keys[t * c.d + j];
          lo = std::min(lo, dot / std::sqrt(mm * kk));
        }
        for (int j = 0; j < c.d; ++j) want_lm[h * l_stride + int64_t(ch) * c.d + j] = float(mean[j]);
        want_mc[h * m_stride + ch] = float(lo);
      }
    EXPECT_TRUE(AllClose(lm, want_lm, 1e-5f, 1e-5f));  // padding stays -7 in both
    EXPECT_TRUE(AllClose(mc, want_mc, 1e-5f, 1e-5f));
  }
}

// landmarks_per_chunk S: chunk c's landmark rows c*S .. c*S+S-1 are the means
// of its S runs of C/S keys; min_cos stays the chunk's (over its own mean).
TEST(ShadowKvPrefillCpuTest, SeveralLandmarksPerChunkAreTheMeansOfItsRuns) {
  const int hkv = 2, d = 16, C = 8, n = 5;
  const int64_t first = 8, k_stride = (first + n * C + 3) * d;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> n01;
  std::vector<float> k(hkv * k_stride);
  for (auto& v : k) v = n01(rng);
  auto run = [&](int S, std::vector<float>* lm, std::vector<float>* mc) {
    const int64_t l_stride = int64_t(n + 1) * S * d;
    lm->assign(hkv * l_stride, -7.0f);
    mc->assign(hkv * (n + 1), -7.0f);
    ChunkLandmarksArgs a;
    a.k = k.data();
    a.k_head_stride = k_stride;
    a.first_token = first;
    a.n_chunks = n;
    a.chunk_tokens = C;
    a.hkv = hkv;
    a.d = d;
    a.landmarks = lm->data();
    a.landmark_head_stride = l_stride;
    a.min_cos = mc->data();
    a.min_cos_head_stride = n + 1;
    a.landmarks_per_chunk = S;
    ChunkLandmarks(a);
    return l_stride;
  };
  std::vector<float> lm1, mc1;
  run(1, &lm1, &mc1);
  for (int S : {2, 4, 8}) {
    SCOPED_TRACE("S " + std::to_string(S));
    std::vector<float> lm, mc;
    const int64_t l_stride = run(S, &lm, &mc);
    EXPECT_EQ(mc, mc1);  // the outlier criterion does not change
    std::vector<float> want(lm.size(), -7.0f);
    const int len = C / S;
    for (int h = 0; h < hkv; ++h)
      for (int c = 0; c < n; ++c)
        for (int s = 0; s < S; ++s)
          for (int j = 0; j < d; ++j) {
            double sum = 0;
            for (int t = 0; t < len; ++t) sum += k[h * k_stride + (first + int64_t(c) * C + s * len + t) * d + j];
            want[h * l_stride + (int64_t(c) * S + s) * d + j] = float(sum / len);
          }
    EXPECT_TRUE(AllClose(lm, want, 1e-6f, 1e-5f));  // the last chunk's padding rows stay -7
  }
}

TEST(ShadowKvPrefillCpuTest, CosineEdgeCases) {
  EXPECT_EQ(ChunkCosine(0, 0, 0), 1.0f);
  EXPECT_EQ(ChunkCosine(0, 0, 2), 0.0f);
  EXPECT_EQ(ChunkCosine(0, 3, 0), 0.0f);
  EXPECT_FLOAT_EQ(ChunkCosine(-2, 4, 1), -1.0f);
}

TEST(ShadowKvPrefillCpuTest, OutlierSelectionMatchesSort) {
  std::mt19937_64 rng(42);
  for (int n : {1, 7, 129, 4100}) {
    for (int O : {0, 1, 5, 48, n}) {
      if (O > n) continue;
      SCOPED_TRACE("n " + std::to_string(n) + " O " + std::to_string(O));
      const int hkv = 3;
      const int64_t stride = n + 4;
      std::vector<float> s(hkv * stride);
      // Few distinct values so ties are common; some NaN and -0.
      for (auto& v : s) {
        const int roll = static_cast<int>(rng() % 40);
        v = roll == 0 ? NAN : roll == 1 ? -0.0f : static_cast<float>(static_cast<int>(rng() % 17) - 8) / 8.0f;
      }
      std::vector<int32_t> out(hkv * O, -1);
      SelectOutlierChunks(s.data(), stride, hkv, n, O, out.data());
      for (int h = 0; h < hkv; ++h) {
        std::vector<int> idx(n);
        std::iota(idx.begin(), idx.end(), 0);
        auto key = [&](int i) {
          const float v = s[h * stride + i];
          return std::isnan(v) ? -INFINITY : v;  // NaN ranks first; no real -inf in this data
        };
        std::stable_sort(idx.begin(), idx.end(), [&](int x, int y) {
          const bool nx = std::isnan(s[h * stride + x]), ny = std::isnan(s[h * stride + y]);
          if (nx != ny) return nx;
          return key(x) < key(y);
        });
        std::vector<int> want(idx.begin(), idx.begin() + O);
        std::sort(want.begin(), want.end());
        const std::vector<int> got(out.begin() + h * O, out.begin() + (h + 1) * O);
        EXPECT_EQ(got, want) << "head " << h;
      }
    }
  }
}

TEST(ShadowKvPrefillCpuTest, GatherOutliersCopiesRowsAndMask) {
  const int hkv = 2, d = 64, C = 8, n_chunks = 9, O = 3;
  const int64_t first_token = 16, kv_stride = (first_token + n_chunks * C) * d;
  std::vector<float> k(hkv * kv_stride), v(hkv * kv_stride);
  for (size_t i = 0; i < k.size(); ++i) k[i] = float(i), v[i] = -float(i);
  const std::vector<int32_t> outliers = {0, 4, 8, 1, 2, 7};
  const int64_t att_stride = (O * C + 10) * d, mask_stride = 16;
  std::vector<float> ak(hkv * att_stride, 0.5f), av(hkv * att_stride, 0.5f);
  std::vector<uint8_t> mask(hkv * mask_stride, 9);
  GatherOutliersArgs a;
  a.k = k.data();
  a.v = v.data();
  a.kv_head_stride = kv_stride;
  a.first_token = first_token;
  a.chunk_tokens = C;
  a.hkv = hkv;
  a.d = d;
  a.n_chunks = n_chunks;
  a.outliers = outliers.data();
  a.num_outliers = O;
  a.att_k = ak.data();
  a.att_v = av.data();
  a.att_head_stride = att_stride;
  a.excluded = mask.data();
  a.mask_head_stride = mask_stride;
  GatherOutliers(a);
  for (int h = 0; h < hkv; ++h) {
    for (int j = 0; j < O; ++j) {
      const int c = outliers[h * O + j];
      for (int e = 0; e < C * d; ++e) {
        const int64_t src = h * kv_stride + (first_token + c * C) * d + e;
        ASSERT_EQ(ak[h * att_stride + j * C * d + e], k[src]);
        ASSERT_EQ(av[h * att_stride + j * C * d + e], v[src]);
      }
    }
    EXPECT_EQ(ak[h * att_stride + O * C * d], 0.5f);  // rows past the outliers untouched
    for (int c = 0; c < mask_stride; ++c) {
      const bool is_out = std::count(outliers.begin() + h * O, outliers.begin() + (h + 1) * O, c) > 0;
      EXPECT_EQ(mask[h * mask_stride + c], c >= n_chunks ? 9 : is_out ? 1 : 0) << h << "," << c;
    }
  }
}

}  // namespace
}  // namespace penumbra::kernels::cpu
