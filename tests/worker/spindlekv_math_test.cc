// SpindleKV's host math (worker/engine/spindlekv_math.h): the retain-ratio
// pyramid, the window scores against a brute-force f64 reference, top-k, and
// the codebook greedy against a naive model that recomputes every degree from
// scratch each round.
#include "worker/engine/spindlekv_math.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace penumbra::spindlekv {
namespace {

double ContextRatio(double r, int64_t prompt, int64_t window) {
  return std::clamp((r * prompt - window) / static_cast<double>(prompt - window), 0.0, 1.0);
}

double Mean(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / v.size(); }

void ExpectNonIncreasing(const std::vector<double>& v) {
  for (size_t i = 1; i < v.size(); ++i) EXPECT_LE(v[i], v[i - 1] + 1e-12) << "layer " << i;
}

TEST(SpindlekvMath, RetainRatiosMeanIsTheContextRatio) {
  const double beta = 0.05;
  const int64_t prompt = 1000, window = 32;
  for (int layers : {2, 3, 32, 80}) {
    for (double r : {0.1, 0.2, 0.3, 0.4, 0.5, 0.52, 0.6, 0.7, 0.9, 0.99}) {
      SCOPED_TRACE(testing::Message() << "r " << r << " layers " << layers);
      const double rc = ContextRatio(r, prompt, window);
      ASSERT_GT(rc, beta);
      const std::vector<double> ratios = RetainRatios(r, prompt, window, beta, layers);
      ASSERT_EQ(ratios.size(), static_cast<size_t>(layers));
      EXPECT_NEAR(Mean(ratios), rc, 1e-12);
      ExpectNonIncreasing(ratios);
      for (double x : ratios) {
        EXPECT_GE(x, 0.0);
        EXPECT_LE(x, 1.0 + 1e-12);
      }
      if (rc <= (1 + beta) / 2) {  // the deep branch: the last layer at the minimum
        EXPECT_NEAR(ratios.front(), 2 * rc - beta, 1e-12);
        EXPECT_DOUBLE_EQ(ratios.back(), beta);
      } else {  // the shallow branch: the first layer keeps everything
        EXPECT_DOUBLE_EQ(ratios.front(), 1.0);
        EXPECT_NEAR(ratios.back(), 2 * rc - 1, 1e-12);
      }
    }
  }
}

TEST(SpindlekvMath, RetainRatiosBranchValues) {
  // prompt 1000, window 0: r_c == r. beta 0.1, alpha 0.55.
  std::vector<double> a = RetainRatios(0.3, 1000, 0, 0.1, 5);
  std::vector<double> want_a = {0.5, 0.4, 0.3, 0.2, 0.1};
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(a[i], want_a[i], 1e-12) << i;
  std::vector<double> b = RetainRatios(0.8, 1000, 0, 0.1, 5);
  std::vector<double> want_b = {1.0, 0.9, 0.8, 0.7, 0.6};
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(b[i], want_b[i], 1e-12) << i;
  // r_c == alpha exactly: both branches agree (first 1, last beta).
  std::vector<double> c = RetainRatios(0.55, 1000, 0, 0.1, 3);
  EXPECT_NEAR(c[0], 1.0, 1e-12);
  EXPECT_NEAR(c[2], 0.1, 1e-12);
  // The window counts: r 0.5 of 200 with 100 in the window leaves r_c 0.
  std::vector<double> d = RetainRatios(0.5, 200, 100, 0.05, 4);
  for (double x : d) EXPECT_EQ(x, 0.0);
}

TEST(SpindlekvMath, RetainRatiosFlatAtOrBelowBeta) {
  for (double r : {0.0, 0.01, 0.04, 0.05}) {
    const std::vector<double> ratios = RetainRatios(r, 1000, 0, 0.05, 16);
    ASSERT_EQ(ratios.size(), 16u);
    for (double x : ratios) EXPECT_DOUBLE_EQ(x, r) << "r " << r;
  }
  // A reserve smaller than the window itself: r_c clamps to 0.
  for (double x : RetainRatios(0.01, 1000, 32, 0.05, 8)) EXPECT_EQ(x, 0.0);
  // r 1 keeps everything in every layer.
  for (double x : RetainRatios(1.0, 1000, 32, 0.05, 8)) EXPECT_NEAR(x, 1.0, 1e-12);
  // r above 1 clamps.
  for (double x : RetainRatios(1.5, 1000, 32, 0.05, 8)) EXPECT_NEAR(x, 1.0, 1e-12);
}

TEST(SpindlekvMath, RetainRatiosShortPromptKeepsAll) {
  for (int64_t prompt : {0, 1, 31, 32}) {
    const std::vector<double> ratios = RetainRatios(0.2, prompt, 32, 0.05, 6);
    ASSERT_EQ(ratios.size(), 6u);
    for (double x : ratios) EXPECT_EQ(x, 1.0) << "prompt " << prompt;
  }
}

TEST(SpindlekvMath, RetainRatiosOneLayerAndNone) {
  const std::vector<double> one = RetainRatios(0.3, 1000, 32, 0.05, 1);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_NEAR(one[0], ContextRatio(0.3, 1000, 32), 1e-12);
  EXPECT_TRUE(RetainRatios(0.3, 1000, 32, 0.05, 0).empty());
}

TEST(SpindlekvMath, KeptTokensBounds) {
  EXPECT_EQ(KeptTokens(0.3, 200), 60);
  EXPECT_EQ(KeptTokens(0.299, 200), 59);
  EXPECT_EQ(KeptTokens(0.0, 200), 0);
  EXPECT_EQ(KeptTokens(-0.5, 200), 0);
  EXPECT_EQ(KeptTokens(1.0, 200), 200);
  EXPECT_EQ(KeptTokens(1.7, 200), 200);
  EXPECT_EQ(KeptTokens(0.5, 0), 0);
  EXPECT_EQ(KeptTokens(0.5, -3), 0);
  EXPECT_EQ(KeptTokens(std::nan(""), 200), 0);
  EXPECT_EQ(KeptTokens(0.999, 10), 9);
  // Ratios that are integers of tokens up to rounding count as such.
  for (int i = 0; i <= 100; ++i) EXPECT_EQ(KeptTokens(i / 100.0, 100), i) << i;
}

// out[t] of WindowScores in f64, straight from the definition.
std::vector<double> ReferenceScores(const std::vector<float>& q, const std::vector<int32_t>& pos, int w,
                                    const std::vector<float>& k, int64_t n, int d, float scale, int pool) {
  std::vector<double> out(n, 0.0);
  for (int b = 0; b < w; ++b) {
    const int64_t end = std::min<int64_t>(pos[b], n - 1) + 1;
    if (end <= 0) continue;
    std::vector<double> s(end);
    double mx = -1e300;
    for (int64_t t = 0; t < end; ++t) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += static_cast<double>(q[b * d + c]) * k[t * d + c];
      s[t] = scale * dot;
      mx = std::max(mx, s[t]);
    }
    double sum = 0;
    for (int64_t t = 0; t < end; ++t) sum += std::exp(s[t] - mx);
    for (int64_t t = 0; t < end; ++t) out[t] += std::exp(s[t] - mx) / sum;
  }
  if (pool <= 1) return out;
  std::vector<double> pooled(n);
  for (int64_t t = 0; t < n; ++t) {
    double s = 0;
    int count = 0;
    for (int64_t u = t - pool / 2; u <= t + pool / 2; ++u) {
      if (u < 0 || u >= n) continue;
      s += out[u];
      ++count;
    }
    pooled[t] = s / count;
  }
  return pooled;
}

TEST(SpindlekvMath, WindowScoresMatchReference) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  struct Case {
    int w;
    int64_t n;
    int d;
    int first_pos;  // the window's first position; rows at first_pos, first_pos + 1, ...
  };
  for (const Case& cs : {Case{1, 1, 4, 0}, Case{4, 20, 8, 16}, Case{5, 37, 13, 30}, Case{8, 130, 64, 122},
                         Case{3, 50, 16, 10}, Case{6, 200, 32, 300}, Case{4, 10, 8, -2}}) {
    for (int pool : {1, 3, 5, 7, 9}) {
      SCOPED_TRACE(testing::Message() << "w " << cs.w << " n " << cs.n << " d " << cs.d << " pool " << pool);
      std::vector<float> q(cs.w * cs.d), k(cs.n * cs.d);
      for (float& x : q) x = normal(rng);
      for (float& x : k) x = normal(rng);
      std::vector<int32_t> pos(cs.w);
      for (int b = 0; b < cs.w; ++b) pos[b] = cs.first_pos + b;
      const float scale = 1.0f / std::sqrt(static_cast<float>(cs.d));
      std::vector<float> out(cs.n, -1.0f);
      WindowScores(q.data(), pos.data(), cs.w, k.data(), cs.n, cs.d, scale, pool, out.data());
      const std::vector<double> want = ReferenceScores(q, pos, cs.w, k, cs.n, cs.d, scale, pool);
      for (int64_t t = 0; t < cs.n; ++t) {
        ASSERT_NEAR(out[t], want[t], 1e-5 * std::max(1.0, std::abs(want[t]))) << "t " << t;
      }
      if (pool == 1) {
        // Each row that sees a key spreads exactly 1.
        int rows = 0;
        for (int b = 0; b < cs.w; ++b) rows += pos[b] >= 0;
        double sum = 0;
        for (float x : out) sum += x;
        EXPECT_NEAR(sum, rows, 1e-5 * std::max(1, rows));
      }
    }
  }
}

TEST(SpindlekvMath, WindowScoresCausalAndPooled) {
  // d 1, q 0: uniform softmax over the visible keys. Rows at positions 1 and 3 over n 6: row 0 gives 1/2 to
  // keys 0..1, row 1 gives 1/4 to keys 0..3; keys 4..5 are never seen.
  const std::vector<float> q = {0.0f, 0.0f}, k = {1, 2, 3, 4, 5, 6};
  const std::vector<int32_t> pos = {1, 3};
  std::vector<float> out(6);
  WindowScores(q.data(), pos.data(), 2, k.data(), 6, 1, 1.0f, 1, out.data());
  const std::vector<float> want = {0.75f, 0.75f, 0.25f, 0.25f, 0.0f, 0.0f};
  for (int t = 0; t < 6; ++t) EXPECT_NEAR(out[t], want[t], 1e-7) << t;
  // Pool 3: the ends divide by 2.
  WindowScores(q.data(), pos.data(), 2, k.data(), 6, 1, 1.0f, 3, out.data());
  const std::vector<float> pooled = {0.75f, 1.75f / 3, 1.25f / 3, 0.5f / 3, 0.25f / 3, 0.0f};
  for (int t = 0; t < 6; ++t) EXPECT_NEAR(out[t], pooled[t], 1e-7) << t;
  // Large logits stay finite (the row max is subtracted).
  const std::vector<float> big_q = {1.0f};
  const std::vector<int32_t> big_pos = {5};
  const std::vector<float> big_k = {1000, 2000, 3000, 4000, 5000, 6000};
  WindowScores(big_q.data(), big_pos.data(), 1, big_k.data(), 6, 1, 1.0f, 1, out.data());
  for (int t = 0; t < 5; ++t) EXPECT_EQ(out[t], 0.0f) << t;
  EXPECT_EQ(out[5], 1.0f);
}

TEST(SpindlekvMath, TopKIndices) {
  const std::vector<float> s = {0.5f, 3.0f, 1.0f, 3.0f, -2.0f, 1.0f, 1.0f, 7.0f};
  EXPECT_EQ(TopKIndices(s.data(), 8, 1), std::vector<int32_t>({7}));
  EXPECT_EQ(TopKIndices(s.data(), 8, 2), std::vector<int32_t>({1, 7}));
  EXPECT_EQ(TopKIndices(s.data(), 8, 3), std::vector<int32_t>({1, 3, 7}));
  // Ties at 1.0 (indices 2, 5, 6): the lower indices win.
  EXPECT_EQ(TopKIndices(s.data(), 8, 4), std::vector<int32_t>({1, 2, 3, 7}));
  EXPECT_EQ(TopKIndices(s.data(), 8, 5), std::vector<int32_t>({1, 2, 3, 5, 7}));
  EXPECT_EQ(TopKIndices(s.data(), 8, 7), std::vector<int32_t>({0, 1, 2, 3, 5, 6, 7}));
  EXPECT_EQ(TopKIndices(s.data(), 8, 8), std::vector<int32_t>({0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(TopKIndices(s.data(), 8, 100), std::vector<int32_t>({0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_TRUE(TopKIndices(s.data(), 8, 0).empty());
  EXPECT_TRUE(TopKIndices(s.data(), 8, -3).empty());
  EXPECT_TRUE(TopKIndices(nullptr, 0, 4).empty());
  // NaN ranks last.
  const std::vector<float> nan = {std::nanf(""), -1.0f, std::nanf(""), -5.0f};
  EXPECT_EQ(TopKIndices(nan.data(), 4, 2), std::vector<int32_t>({1, 3}));
  EXPECT_EQ(TopKIndices(nan.data(), 4, 3), std::vector<int32_t>({0, 1, 3}));
  // Against a full sort on random data with many ties.
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> value(0, 20);
  for (int trial = 0; trial < 50; ++trial) {
    const int n = 1 + trial * 7;
    std::vector<float> r(n);
    for (float& x : r) x = static_cast<float>(value(rng));
    std::vector<int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return r[a] > r[b]; });
    for (int k : {0, 1, n / 3, n / 2, n - 1, n}) {
      std::vector<int32_t> want(order.begin(), order.begin() + std::max(k, 0));
      std::sort(want.begin(), want.end());
      EXPECT_EQ(TopKIndices(r.data(), n, k), want) << "n " << n << " k " << k;
    }
  }
}

// The held tokens of each KV head: its query heads' top tokens of the
// context (ties: the lower index) and the window, as a union with the mask
// of the query heads keeping each one. 4 query heads over 2 KV heads, 8
// tokens of which the last 2 are the window, keep 2 of the context.
TEST(SpindlekvMath, SelectHeld) {
  const std::vector<float> scores = {
      9, 8, 0, 0, 0, 0, 5, 5,  // head 0 (KV head 0): tokens 0 and 1
      0, 9, 8, 0, 0, 0, 0, 0,  // head 1 (KV head 0): 1 and 2
      1, 1, 1, 1, 1, 1, 1, 1,  // head 2 (KV head 1): all tied: 0 and 1
      0, 0, 0, 0, 0, 7, 0, 0,  // head 3 (KV head 1): 5, then the tie at 0: 0
  };
  std::vector<std::vector<int32_t>> pos;
  std::vector<std::vector<uint32_t>> heads;
  SelectHeld(scores.data(), 8, 6, 2, 4, 2, &pos, &heads);
  ASSERT_EQ(pos.size(), 2u);
  EXPECT_EQ(pos[0], std::vector<int32_t>({0, 1, 2, 6, 7}));
  EXPECT_EQ(heads[0], std::vector<uint32_t>({0b01, 0b11, 0b10, 0b11, 0b11}));
  EXPECT_EQ(pos[1], std::vector<int32_t>({0, 1, 5, 6, 7}));
  EXPECT_EQ(heads[1], std::vector<uint32_t>({0b11, 0b01, 0b10, 0b11, 0b11}));
  // Keep everything: no scores needed, every head keeps every token.
  SelectHeld(nullptr, 8, 6, 6, 4, 2, &pos, &heads);
  for (int g = 0; g < 2; ++g) {
    EXPECT_EQ(pos[g], std::vector<int32_t>({0, 1, 2, 3, 4, 5, 6, 7}));
    EXPECT_EQ(heads[g], std::vector<uint32_t>(8, 0b11));
  }
  // Keep none of the context: the window alone.
  SelectHeld(scores.data(), 8, 6, 0, 4, 2, &pos, &heads);
  EXPECT_EQ(pos[0], std::vector<int32_t>({6, 7}));
  EXPECT_EQ(heads[1], std::vector<uint32_t>({0b11, 0b11}));
}

// The layer ratios: the pyramid when the prompt evicts, everything kept
// below min_prompt.
TEST(SpindlekvMath, LayerRatios) {
  EXPECT_EQ(LayerRatios(0.3, 0.05, 200, 16, 100, 5), RetainRatios(0.3, 200, 16, 0.05, 5));
  EXPECT_EQ(LayerRatios(0.3, 0.05, 99, 16, 100, 5), std::vector<double>(5, 1.0));
}

// ---- codebooks ----

struct Built {
  Codebook cb;
  std::vector<int32_t> refs;
  std::vector<float> mags;
};

Built Build(const std::vector<float>& x, int d, float theta, int block) {
  Built b;
  const int64_t n = static_cast<int64_t>(x.size()) / d;
  b.refs.assign(n, -7);
  b.mags.assign(n, -7.0f);
  BuildCodebook(x.data(), n, d, theta, block, &b.cb, b.refs.data(), b.mags.data());
  return b;
}

double CosF64(const float* a, const float* b, int d) {
  double ab = 0, aa = 0, bb = 0;
  for (int c = 0; c < d; ++c) {
    ab += static_cast<double>(a[c]) * b[c];
    aa += static_cast<double>(a[c]) * a[c];
    bb += static_cast<double>(b[c]) * b[c];
  }
  return ab / std::sqrt(aa * bb);
}

double NormF64(const float* a, int d) {
  double s = 0;
  for (int c = 0; c < d; ++c) s += static_cast<double>(a[c]) * a[c];
  return std::sqrt(s);
}

// Rows scattered around `clusters` random directions with noise of varying size (so similarity is far from
// transitive) and random magnitudes.
std::vector<float> Clustered(int64_t n, int d, int clusters, float noise, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> centers(static_cast<size_t>(clusters) * d);
  for (float& c : centers) c = normal(rng);
  std::uniform_int_distribution<int> pick(0, clusters - 1);
  std::vector<float> x(static_cast<size_t>(n) * d);
  for (int64_t i = 0; i < n; ++i) {
    const float* c = &centers[static_cast<size_t>(pick(rng)) * d];
    const float sigma = noise * (0.25f + unit(rng));
    const float m = 0.1f + 3.0f * unit(rng);
    for (int j = 0; j < d; ++j) x[i * d + j] = m * (c[j] + sigma * normal(rng));
  }
  return x;
}

// Every row references an existing entry, which is within theta of it (up to f32 rounding of the cosine),
// and the magnitudes are the norms.
void ExpectInvariant(const std::vector<float>& x, int d, float theta, const Built& b, int32_t first_entry = 0) {
  const int64_t n = static_cast<int64_t>(x.size()) / d;
  ASSERT_EQ(b.cb.d, d);
  for (int32_t e = 0; e < b.cb.size(); ++e) ASSERT_NEAR(NormF64(b.cb.entry(e), d), 1.0, 1e-5) << "entry " << e;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = &x[i * d];
    ASSERT_GE(b.refs[i], 0) << "row " << i;
    ASSERT_LT(b.refs[i], b.cb.size()) << "row " << i;
    ASSERT_NEAR(b.mags[i], NormF64(row, d), 1e-5 * NormF64(row, d)) << "row " << i;
    if (b.mags[i] == 0) continue;  // a zero row: any entry
    ASSERT_GE(b.refs[i], first_entry) << "row " << i;
    const double cos = CosF64(row, b.cb.entry(b.refs[i]), d);
    ASSERT_GT(cos, static_cast<double>(theta) - 1e-5) << "row " << i << " entry " << b.refs[i];
  }
}

TEST(SpindlekvMath, BuildCodebookInvariant) {
  std::mt19937 rng(11);
  for (int d : {3, 16, 64}) {
    for (float theta : {0.0f, 0.5f, 0.8f, 0.95f}) {
      for (int block : {0, 1, 8, 13, 64, 1000}) {
        SCOPED_TRACE(testing::Message() << "d " << d << " theta " << theta << " block " << block);
        const std::vector<float> x = Clustered(150, d, 6, 0.4f, rng);
        const Built b = Build(x, d, theta, block);
        ExpectInvariant(x, d, theta, b);
        EXPECT_LE(b.cb.size(), 150);
        if (block == 1) {
          EXPECT_EQ(b.cb.size(), 150);  // a block of one row cannot merge
        }
        // Every entry is one of the rows, normalized, and that row references it.
        for (int32_t e = 0; e < b.cb.size(); ++e) {
          bool found = false;
          for (int64_t i = 0; i < 150 && !found; ++i) {
            if (b.refs[i] != e) continue;
            double err = 0;
            for (int c = 0; c < d; ++c)
              err = std::max<double>(err, std::abs(b.cb.entry(e)[c] - x[i * d + c] / b.mags[i]));
            found = err < 1e-5;
          }
          EXPECT_TRUE(found) << "entry " << e << " is none of its rows";
        }
      }
    }
  }
}

TEST(SpindlekvMath, BuildCodebookWithoutMergingReconstructsEveryRow) {
  std::mt19937 rng(5);
  const int d = 32;
  const std::vector<float> x = Clustered(100, d, 3, 0.05f, rng);  // very similar rows, but none equal
  for (float theta : {1.0f, 1.5f}) {
    const Built b = Build(x, d, theta, 0);
    ASSERT_EQ(b.cb.size(), 100);
    std::vector<float> out(d);
    for (int64_t i = 0; i < 100; ++i) {
      EXPECT_EQ(b.refs[i], i);  // every row its own entry, in order (all of degree 1)
      Reconstruct(b.cb, b.refs[i], b.mags[i], out.data());
      const double norm = NormF64(&x[i * d], d);
      for (int c = 0; c < d; ++c) ASSERT_NEAR(out[c], x[i * d + c], 1e-5 * norm) << "row " << i << " c " << c;
    }
  }
}

TEST(SpindlekvMath, BuildCodebookDuplicatesShareEntries) {
  std::mt19937 rng(9);
  const int d = 24;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> base(10 * d);  // 10 random rows (checked dissimilar below)
  for (float& v : base) v = normal(rng);
  // 40 rows: each base row 4 times, scaled differently (the same direction), interleaved.
  std::vector<float> x;
  std::vector<int> source;
  for (int rep = 0; rep < 4; ++rep) {
    for (int i = 0; i < 10; ++i) {
      for (int c = 0; c < d; ++c) x.push_back(base[i * d + c] * (1.0f + rep));
      source.push_back(i);
    }
  }
  for (int i = 0; i < 10; ++i) {
    for (int j = i + 1; j < 10; ++j) ASSERT_LT(CosF64(&base[i * d], &base[j * d], d), 0.99);
  }
  const Built b = Build(x, d, 0.99f, 0);
  ExpectInvariant(x, d, 0.99f, b);
  EXPECT_EQ(b.cb.size(), 10);
  for (size_t r = 0; r < source.size(); ++r) EXPECT_EQ(b.refs[r], b.refs[source[r]]) << "row " << r;
  std::vector<float> out(d);
  for (size_t r = 0; r < source.size(); ++r) {
    Reconstruct(b.cb, b.refs[r], b.mags[r], out.data());
    for (int c = 0; c < d; ++c) EXPECT_NEAR(out[c], x[r * d + c], 1e-5 * b.mags[r]);
  }
}

TEST(SpindlekvMath, BuildCodebookBlockedNeverMergesAcrossBlocks) {
  std::mt19937 rng(13);
  const int d = 16, block = 8;
  // 6 blocks of 8 rows from 4 clusters (tight: many merges within a block).
  const std::vector<float> x = Clustered(48, d, 4, 0.1f, rng);
  const float theta = 0.8f;
  const Built blocked = Build(x, d, theta, block);
  const Built whole = Build(x, d, theta, 48);
  const Built whole2 = Build(x, d, theta, 0);
  ExpectInvariant(x, d, theta, blocked);
  ExpectInvariant(x, d, theta, whole);
  EXPECT_EQ(whole.refs, whole2.refs);
  EXPECT_EQ(whole.cb.entries, whole2.cb.entries);
  EXPECT_LT(whole.cb.size(), blocked.cb.size());
  // Blocked: an entry's rows all lie in one block, and the blocks' entries come in block order.
  std::vector<int> block_of(blocked.cb.size(), -1);
  for (int i = 0; i < 48; ++i) {
    int& owner = block_of[blocked.refs[i]];
    if (owner < 0) owner = i / block;
    EXPECT_EQ(owner, i / block) << "row " << i << " shares entry " << blocked.refs[i] << " across blocks";
  }
  EXPECT_TRUE(std::is_sorted(block_of.begin(), block_of.end()));
  // Each block alone gives the same refs (shifted) and entries.
  int32_t offset = 0;
  for (int b0 = 0; b0 < 48; b0 += block) {
    const std::vector<float> part(x.begin() + b0 * d, x.begin() + (b0 + block) * d);
    const Built one = Build(part, d, theta, 0);
    for (int i = 0; i < block; ++i) EXPECT_EQ(blocked.refs[b0 + i], one.refs[i] + offset) << "row " << b0 + i;
    for (size_t c = 0; c < one.cb.entries.size(); ++c) EXPECT_EQ(blocked.cb.entries[offset * d + c], one.cb.entries[c]);
    offset += one.cb.size();
  }
  EXPECT_EQ(offset, blocked.cb.size());
}

TEST(SpindlekvMath, BuildCodebookPicksTheHighestDegreeFirst) {
  // A star: the center e_0 at row 3; leaves e_0 + 0.75 e_{i+1}: cos(center, leaf) 0.8, cos(leaf, leaf') 0.64.
  // With theta 0.7 the center has degree 6, every leaf 2: one entry, the center's direction. (Taking rows in
  // order instead would make row 0 an entry first, then the center, then the leaves it does not cover.)
  const int d = 8;
  std::vector<float> x(6 * d, 0.0f);
  int leaf = 0;
  for (int i = 0; i < 6; ++i) {
    x[i * d] = 2.0f;
    if (i == 3) continue;
    x[i * d + 1 + leaf++] = 1.5f;
  }
  const Built b = Build(x, d, 0.7f, 0);
  ASSERT_EQ(b.cb.size(), 1);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(b.refs[i], 0);
  for (int c = 0; c < d; ++c) EXPECT_EQ(b.cb.entry(0)[c], c == 0 ? 1.0f : 0.0f);
  EXPECT_FLOAT_EQ(b.mags[3], 2.0f);
  EXPECT_FLOAT_EQ(b.mags[0], 2.5f);
  // Above 0.8 nothing merges; between 0.64 and 0.8 the star holds; below 0.64 the leaves join each other, and
  // every row has degree 6: row 0 (a leaf) wins the tie and covers all.
  EXPECT_EQ(Build(x, d, 0.85f, 0).cb.size(), 6);
  const Built low = Build(x, d, 0.5f, 0);
  ASSERT_EQ(low.cb.size(), 1);
  EXPECT_NEAR(low.cb.entry(0)[1], 0.6f, 1e-6);
}

TEST(SpindlekvMath, BuildCodebookAppendsToExistingEntries) {
  std::mt19937 rng(17);
  const int d = 12;
  const std::vector<float> a = Clustered(30, d, 3, 0.2f, rng), x = Clustered(40, d, 3, 0.2f, rng);
  Built first = Build(a, d, 0.7f, 0);
  const std::vector<float> before = first.cb.entries;
  const int32_t existing = first.cb.size();
  std::vector<int32_t> refs(40);
  std::vector<float> mags(40);
  BuildCodebook(x.data(), 40, d, 0.7f, 16, &first.cb, refs.data(), mags.data());
  EXPECT_TRUE(std::equal(before.begin(), before.end(), first.cb.entries.begin()));
  const Built fresh = Build(x, d, 0.7f, 16);
  ASSERT_EQ(first.cb.size(), existing + fresh.cb.size());
  for (int i = 0; i < 40; ++i) EXPECT_EQ(refs[i], fresh.refs[i] + existing) << i;
  Built appended{first.cb, refs, mags};
  ExpectInvariant(x, d, 0.7f, appended, existing);
}

TEST(SpindlekvMath, BuildCodebookZeroRows) {
  const int d = 4;
  // All zero, empty codebook: one e_0 entry for them all.
  const Built zeros = Build(std::vector<float>(3 * d, 0.0f), d, 0.5f, 0);
  ASSERT_EQ(zeros.cb.size(), 1);
  EXPECT_EQ(zeros.cb.entries, std::vector<float>({1, 0, 0, 0}));
  EXPECT_EQ(zeros.refs, std::vector<int32_t>({0, 0, 0}));
  EXPECT_EQ(zeros.mags, std::vector<float>({0, 0, 0}));
  // Mixed, and a negative theta (everything similar): zero rows stay out of the graph, reference entry 0 and
  // reconstruct to zero.
  const std::vector<float> x = {0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, -2, 0};
  for (float theta : {-2.0f, 0.5f}) {
    const Built b = Build(x, d, theta, 0);
    EXPECT_EQ(b.cb.size(), theta < 0 ? 1 : 2);
    EXPECT_EQ(b.refs[0], 0);
    EXPECT_EQ(b.refs[2], 0);
    EXPECT_EQ(b.mags[0], 0.0f);
    EXPECT_EQ(b.mags[1], 3.0f);
    EXPECT_EQ(b.mags[3], 2.0f);
    std::vector<float> out(d, 1.0f);
    Reconstruct(b.cb, b.refs[0], b.mags[0], out.data());
    for (float v : out) EXPECT_EQ(v, 0.0f);
    if (theta > 0) {
      Reconstruct(b.cb, b.refs[3], b.mags[3], out.data());
      EXPECT_EQ(out, std::vector<float>({0, 0, -2, 0}));
    }
  }
}

// ---- the naive model of Algorithm 1 ----

// The rows normalized as the module does (f64 norm, f32 quotient); zero rows stay zero and are flagged.
std::vector<float> Normalized(const float* x, int64_t n, int d, std::vector<bool>* dir) {
  std::vector<float> u(n * d, 0.0f);
  dir->assign(n, false);
  for (int64_t i = 0; i < n; ++i) {
    const double norm = NormF64(x + i * d, d);
    if (!(norm > 0)) continue;
    (*dir)[i] = true;
    for (int c = 0; c < d; ++c) u[i * d + c] = static_cast<float>(x[i * d + c] / norm);
  }
  return u;
}

// A plain sequential f32 dot product (what the module's tiled product computes for each pair).
float DotSeq(const float* a, const float* b, int d) {
  float s = 0;
  for (int c = 0; c < d; ++c) s += a[c] * b[c];
  return s;
}

// Algorithm 1 per block with a full adjacency matrix and every degree recomputed each round.
Built NaiveBuild(const std::vector<float>& x, int d, float theta, int block) {
  const int64_t n = static_cast<int64_t>(x.size()) / d;
  Built out;
  out.cb.d = d;
  out.refs.assign(n, -1);
  out.mags.resize(n);
  std::vector<bool> dir;
  const std::vector<float> u = Normalized(x.data(), n, d, &dir);
  for (int64_t i = 0; i < n; ++i) out.mags[i] = static_cast<float>(NormF64(&x[i * d], d));
  const int64_t bs = block > 0 ? std::min<int64_t>(block, n) : n;
  for (int64_t b0 = 0; b0 < n; b0 += bs) {
    const int64_t B = std::min(bs, n - b0);
    std::vector<std::vector<bool>> g(B, std::vector<bool>(B, false));
    for (int64_t a = 0; a < B; ++a) {
      for (int64_t b = 0; b < B; ++b) {
        if (!dir[b0 + a] || !dir[b0 + b]) continue;
        g[a][b] = a == b || DotSeq(&u[(b0 + a) * d], &u[(b0 + b) * d], d) > theta;
      }
    }
    std::vector<bool> alive(B);
    for (int64_t a = 0; a < B; ++a) alive[a] = dir[b0 + a];
    for (;;) {
      int64_t best = -1, best_deg = -1;
      for (int64_t a = 0; a < B; ++a) {
        if (!alive[a]) continue;
        int64_t deg = 0;
        for (int64_t b = 0; b < B; ++b) deg += alive[b] && g[a][b];
        if (deg > best_deg) best_deg = deg, best = a;
      }
      if (best < 0) break;
      const int32_t e = out.cb.size();
      out.cb.entries.insert(out.cb.entries.end(), &u[(b0 + best) * d], &u[(b0 + best) * d] + d);
      std::vector<int64_t> taken;
      for (int64_t b = 0; b < B; ++b) {
        if (alive[b] && g[best][b]) taken.push_back(b);
      }
      for (int64_t b : taken) {
        out.refs[b0 + b] = e;
        alive[b] = false;
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (out.refs[i] >= 0) continue;
    if (out.cb.size() == 0) out.cb.entries.assign(d, 0.0f), out.cb.entries[0] = 1.0f;
    out.refs[i] = 0;
  }
  return out;
}

// theta nudged until no pair of one block has a cosine within 2e-6 of it, so the two implementations cannot
// disagree on a borderline pair whatever order their f32 dot products sum in.
float ClearTheta(const std::vector<float>& x, int d, int block, float theta) {
  const int64_t n = static_cast<int64_t>(x.size()) / d;
  const int64_t bs = block > 0 ? std::min<int64_t>(block, n) : n;
  std::vector<bool> dir;
  const std::vector<float> u = Normalized(x.data(), n, d, &dir);
  std::vector<float> sims;
  for (int64_t a = 0; a < n; ++a) {
    for (int64_t b = a + 1; b < n && b / bs == a / bs; ++b) sims.push_back(DotSeq(&u[a * d], &u[b * d], d));
  }
  for (int attempt = 0; attempt < 1000; ++attempt) {
    bool clear = true;
    for (float s : sims) clear = clear && std::abs(s - theta) >= 2e-6f;
    if (clear) return theta;
    theta += 1.3e-5f;
  }
  ADD_FAILURE() << "no clear threshold near " << theta;
  return theta;
}

TEST(SpindlekvMath, BuildCodebookMatchesTheNaiveGreedy) {
  std::mt19937 rng(21);
  int trials = 0, merged = 0;
  for (int64_t n : {1, 2, 7, 64, 65, 150, 260}) {
    for (int d : {5, 32}) {
      for (int block : {0, 16, 50, 64}) {
        for (float theta0 : {0.2f, 0.55f, 0.85f}) {
          for (int clusters : {2, 8}) {
            std::vector<float> x = Clustered(n, d, clusters, 0.6f, rng);
            if (n > 10) std::fill(x.begin() + 3 * d, x.begin() + 4 * d, 0.0f);  // a zero row
            const float theta = ClearTheta(x, d, block, theta0);
            SCOPED_TRACE(testing::Message() << "n " << n << " d " << d << " block " << block << " theta " << theta
                                            << " clusters " << clusters);
            const Built got = Build(x, d, theta, block);
            const Built want = NaiveBuild(x, d, theta, block);
            ASSERT_EQ(got.refs, want.refs);
            ASSERT_EQ(got.cb.entries, want.cb.entries);
            ASSERT_EQ(got.mags, want.mags);
            ExpectInvariant(x, d, theta, got);
            ++trials;
            merged += got.cb.size() < n;
          }
        }
      }
    }
  }
  EXPECT_GT(merged, trials / 2);  // the data exercises merging, not only isolated rows
}

TEST(SpindlekvMath, MergeOrAdd) {
  Codebook cb;
  cb.d = 3;
  float mag = -1;
  // Empty: the first row is a new entry.
  const float v0[3] = {3, 0, 0};
  EXPECT_EQ(MergeOrAdd(v0, 0.9f, &cb, &mag), 0);
  EXPECT_EQ(mag, 3.0f);
  EXPECT_EQ(cb.entries, std::vector<float>({1, 0, 0}));
  const float v1[3] = {0, 0, -2};
  EXPECT_EQ(MergeOrAdd(v1, 0.9f, &cb, &mag), 1);
  EXPECT_EQ(cb.entries, std::vector<float>({1, 0, 0, 0, 0, -1}));
  // Similar to both entries, closer to entry 1: it references entry 1.
  const float v2[3] = {0.3f, 0, -1};  // cos 0.287 with entry 0, 0.958 with entry 1
  EXPECT_EQ(MergeOrAdd(v2, 0.2f, &cb, &mag), 1);
  EXPECT_NEAR(mag, std::sqrt(1.09f), 1e-6);
  EXPECT_EQ(cb.size(), 2);
  // Above theta for none: appended, normalized.
  EXPECT_EQ(MergeOrAdd(v2, 0.96f, &cb, &mag), 2);
  ASSERT_EQ(cb.size(), 3);
  EXPECT_NEAR(NormF64(cb.entry(2), 3), 1.0, 1e-6);
  std::vector<float> out(3);
  Reconstruct(cb, 2, mag, out.data());
  for (int c = 0; c < 3; ++c) EXPECT_NEAR(out[c], v2[c], 1e-6);
  // cos 0.6, 0.8 and 0.938 with entries 0..2: at 0.9 it merges into entry 2, at 0.95 it is a new entry, and
  // then its own entry is the most similar.
  const float v3[3] = {0.6f, 0, -0.8f};
  EXPECT_EQ(MergeOrAdd(v3, 0.9f, &cb, &mag), 2);
  EXPECT_EQ(MergeOrAdd(v3, 0.95f, &cb, &mag), 3);
  EXPECT_EQ(MergeOrAdd(v3, 0.5f, &cb, &mag), 3);
  // Strictly greater: a row at cosine 1 with entry 0 does not merge at theta 1.
  EXPECT_EQ(MergeOrAdd(v0, 1.0f, &cb, &mag), 4);
  EXPECT_EQ(MergeOrAdd(v0, 0.99f, &cb, &mag), 0);  // the lowest index of the tie
  // A window of the last entries: entries 3 and 4 (v3's, v0's) for v0, which
  // takes entry 4; of the last one only (4) for v3, which adds entry 5 below
  // theta; a window past the size is the whole codebook.
  EXPECT_EQ(MergeOrAdd(v0, 0.99f, &cb, &mag, 2), 4);
  EXPECT_EQ(MergeOrAdd(v3, 0.9f, &cb, &mag, 1), 5);
  EXPECT_EQ(MergeOrAdd(v0, 0.99f, &cb, &mag, 100), 0);
  cb.entries.resize(5 * 3);
  // A zero row references entry 0 and reconstructs to zero.
  const float z[3] = {0, 0, 0};
  EXPECT_EQ(MergeOrAdd(z, 0.5f, &cb, &mag), 0);
  EXPECT_EQ(mag, 0.0f);
  EXPECT_EQ(cb.size(), 5);
  Codebook empty;
  empty.d = 3;
  EXPECT_EQ(MergeOrAdd(z, 0.5f, &empty, &mag), 0);
  EXPECT_EQ(empty.entries, std::vector<float>({1, 0, 0}));
}

TEST(SpindlekvMath, MergeOrAddAgreesWithAFullScan) {
  std::mt19937 rng(29);
  const int d = 16;
  const std::vector<float> x = Clustered(300, d, 10, 0.3f, rng);
  Codebook cb;
  cb.d = d;
  for (int i = 0; i < 300; ++i) {
    const float* v = &x[i * d];
    int32_t best = -1;
    double best_sim = -2;
    for (int32_t e = 0; e < cb.size(); ++e) {
      const double s = CosF64(v, cb.entry(e), d);
      if (s > best_sim) best_sim = s, best = e;
    }
    const int32_t size = cb.size();
    float mag;
    const int32_t ref = MergeOrAdd(v, 0.8f, &cb, &mag);
    EXPECT_NEAR(mag, NormF64(v, d), 1e-5 * NormF64(v, d));
    if (best >= 0 && best_sim > 0.8 + 1e-5) {
      EXPECT_EQ(ref, best) << "row " << i;
      EXPECT_EQ(cb.size(), size);
    } else if (best < 0 || best_sim < 0.8 - 1e-5) {
      EXPECT_EQ(ref, size) << "row " << i;
      EXPECT_EQ(cb.size(), size + 1);
    }
  }
  EXPECT_LT(cb.size(), 100);
}

}  // namespace
}  // namespace penumbra::spindlekv
