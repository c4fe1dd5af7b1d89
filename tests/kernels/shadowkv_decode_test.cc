// CPU references of the ShadowKV decode kernels and of top-k, checked against
// naive implementations (explicit softmax, std::sort, a std::set model of the
// slot map, double-precision rebuild).
#include "kernels/cpu/shadowkv_decode.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace penumbra::kernels::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- top-k -------------------------------------------------------------------

std::vector<int32_t> NaiveTopK(const float* v, int n, int k, bool smallest, bool skip) {
  std::vector<int32_t> idx;
  for (int i = 0; i < n; ++i)
    if (!(skip && (std::isnan(v[i]) || v[i] == (smallest ? kInf : -kInf)))) idx.push_back(i);
  std::stable_sort(idx.begin(), idx.end(),
                   [&](int32_t x, int32_t y) { return TopKKey(v[x], smallest) > TopKKey(v[y], smallest); });
  idx.resize(std::min<size_t>(k, idx.size()));
  std::sort(idx.begin(), idx.end());
  idx.resize(k, -1);
  return idx;
}

TEST(TopKCpu, MatchesStableSortWithTiesNanAndInf) {
  std::mt19937 rng(1);
  for (int n : {1, 7, 129, 5000}) {
    for (int k : {1, 5, 64, 256, 6000}) {
      for (bool smallest : {false, true}) {
        for (int mode = 0; mode < 4; ++mode) {
          const bool skip = mode == 3;
          const int rows = 3, stride = n + 3;
          std::vector<float> v(static_cast<size_t>(rows) * stride, 1e30f);
          std::uniform_real_distribution<float> u(-1.0f, 1.0f);
          std::uniform_int_distribution<int> small(0, 4);
          for (auto& x : v) {
            if (mode == 0)
              x = u(rng);
            else if (mode == 1)
              x = static_cast<float>(small(rng));  // many ties
            else {
              const int s = small(rng);
              x = s == 0   ? std::numeric_limits<float>::quiet_NaN()
                  : s == 1 ? -kInf
                  : s == 2 ? -0.0f
                  : s == 3 ? kInf
                           : u(rng);
            }
          }
          std::vector<int32_t> counts = {n, std::max(0, n - 3), n};
          std::vector<int32_t> out(static_cast<size_t>(rows) * (k + 2), -7);
          TopKArgs a;
          a.values = v.data();
          a.stride = stride;
          a.rows = rows;
          a.counts = counts.data();
          a.k = k;
          a.smallest = smallest;
          a.skip_worst_inf = skip;
          a.out = out.data();
          a.out_stride = k + 2;
          TopK(a);
          for (int r = 0; r < rows; ++r) {
            const auto want = NaiveTopK(v.data() + r * stride, counts[r], k, smallest, skip);
            const std::vector<int32_t> got(out.begin() + r * (k + 2), out.begin() + r * (k + 2) + k);
            ASSERT_EQ(got, want) << "n " << n << " k " << k << " smallest " << smallest << " mode " << mode << " row "
                                 << r;
            EXPECT_EQ(out[r * (k + 2) + k], -7);  // past k untouched
          }
        }
      }
    }
  }
}

TEST(TopKCpu, UniformCountAndRowsPerCount) {
  std::vector<float> v = {3, 1, 2, 5, 4, 0, 9, 8};
  std::vector<int32_t> out(4);
  TopKArgs a;
  a.values = v.data();
  a.stride = 4;
  a.rows = 2;
  a.uniform_count = 4;
  a.k = 2;
  a.out = out.data();
  a.out_stride = 2;
  TopK(a);
  EXPECT_EQ(out, (std::vector<int32_t>{0, 3, 2, 3}));  // {3, 5} and {9, 8}
  // One count shared by both rows, smallest mode.
  const int32_t count = 3;
  a.counts = &count;
  a.rows_per_count = 2;
  a.smallest = true;
  TopK(a);
  EXPECT_EQ(out, (std::vector<int32_t>{1, 2, 0, 1}));  // {1, 2} of {3,1,2}; {4, 0} of {4,0,9}
}

// ---- scores ------------------------------------------------------------------

TEST(ShadowkvScoreCpu, MatchesExplicitSoftmax) {
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int n : {1, 7, 129, 5000}) {
    for (int group : {1, 3, 4}) {
      const int batch = 2, hkv = 2, hq = hkv * group, d = 64, cap = n + 5, max_chunks = n + 2;
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      std::vector<float> q(static_cast<size_t>(batch) * hq * d);
      for (auto& x : q) x = nd(rng);
      std::vector<std::vector<float>> land(batch, std::vector<float>(static_cast<size_t>(hkv) * cap * d));
      std::vector<std::vector<uint8_t>> excl(batch, std::vector<uint8_t>(static_cast<size_t>(hkv) * cap));
      for (auto& l : land)
        for (auto& x : l) x = nd(rng);
      for (auto& e : excl)
        for (auto& x : e) x = (rng() % 10) == 0;
      std::vector<int32_t> n_chunks = {n, std::max(1, n / 2)};
      std::vector<const float*> lp = {land[0].data(), land[1].data()};
      std::vector<const uint8_t*> ep = {excl[0].data(), excl[1].data()};
      const int stride = max_chunks + 1;
      std::vector<float> scores(static_cast<size_t>(batch) * hkv * stride, 123.0f);
      ShadowkvScoreArgs a;
      a.q = q.data();
      a.landmarks = lp.data();
      a.excluded = ep.data();
      a.n_chunks = n_chunks.data();
      a.batch = batch;
      a.hq = hq;
      a.hkv = hkv;
      a.d = d;
      a.chunk_cap = cap;
      a.max_chunks = max_chunks;
      a.scale = scale;
      a.scores = scores.data();
      a.score_stride = stride;
      ShadowkvScore(a);

      std::vector<float> want(scores.size(), 123.0f);
      for (int b = 0; b < batch; ++b)
        for (int h = 0; h < hkv; ++h) {
          float* w = want.data() + (b * hkv + h) * stride;
          for (int c = 0; c < max_chunks; ++c) w[c] = -kInf;
          for (int g = 0; g < group; ++g) {
            const float* qq = q.data() + (b * hq + h * group + g) * d;
            std::vector<double> logit(n_chunks[b]);
            double mx = -1e300;
            for (int c = 0; c < n_chunks[b]; ++c) {
              double s = 0;
              for (int j = 0; j < d; ++j) s += double(qq[j]) * land[b][(static_cast<size_t>(h) * cap + c) * d + j];
              logit[c] = s * scale;
              if (!excl[b][h * cap + c]) mx = std::max(mx, logit[c]);
            }
            double sum = 0;
            for (int c = 0; c < n_chunks[b]; ++c)
              if (!excl[b][h * cap + c]) sum += std::exp(logit[c] - mx);
            for (int c = 0; c < n_chunks[b]; ++c)
              if (!excl[b][h * cap + c]) w[c] = std::max(w[c], static_cast<float>(std::exp(logit[c] - mx) / sum));
          }
        }
      EXPECT_TRUE(testing::AllClose(scores, want, 1e-30f, 2e-5f)) << "n " << n << " group " << group;
    }
  }
}

// One sequence's (batch 1) score arguments over host arrays; the pointer
// arrays the arguments point to live in this object across calls.
struct OneSequenceScore {
  const float* landmarks = nullptr;
  const uint8_t* excluded = nullptr;
  int32_t chunks = 0;
  ShadowkvScoreArgs Args(const float* q, int hq, int hkv, int d, float scale, const float* l, const uint8_t* e, int cap,
                         int n, int max_chunks, float* out, int64_t stride) {
    landmarks = l;
    excluded = e;
    chunks = n;
    ShadowkvScoreArgs a;
    a.q = q;
    a.landmarks = &landmarks;
    a.excluded = &excluded;
    a.n_chunks = &chunks;
    a.batch = 1;
    a.hq = hq;
    a.hkv = hkv;
    a.d = d;
    a.chunk_cap = cap;
    a.max_chunks = max_chunks;
    a.scale = scale;
    a.scores = out;
    a.score_stride = stride;
    return a;
  }
};

// successors: a selectable chunk scores as high as its best of the
// `successors` chunks before it; an excluded chunk stays -inf and passes
// nothing on; chunks past n_chunks stay -inf.
TEST(ShadowkvScoreCpu, SuccessorsTakeTheBestOfThePredecessors) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int hkv = 2, group = 2, hq = hkv * group, d = 8, n = 40, cap = 44, stride = 45;
  std::vector<float> q(static_cast<size_t>(hq) * d), land(static_cast<size_t>(hkv) * cap * d);
  std::vector<uint8_t> excl(static_cast<size_t>(hkv) * cap, 0);
  for (auto& x : q) x = nd(rng);
  for (auto& x : land) x = nd(rng);
  excl[5] = excl[6] = excl[cap + 20] = 1;
  OneSequenceScore one;
  auto run = [&](int successors) {
    std::vector<float> out(static_cast<size_t>(hkv) * stride, 9.0f);
    ShadowkvScoreArgs a =
        one.Args(q.data(), hq, hkv, d, 0.5f, land.data(), excl.data(), cap, n, n + 2, out.data(), stride);
    a.successors = successors;
    ShadowkvScore(a);
    return out;
  };
  const std::vector<float> own = run(0);
  for (int succ : {1, 3}) {
    const std::vector<float> got = run(succ);
    for (int h = 0; h < hkv; ++h) {
      for (int c = 0; c < n + 2; ++c) {
        const float* o = own.data() + h * stride;
        float want = o[c];
        if (c < n && o[c] != -kInf)
          for (int j = 1; j <= succ && c - j >= 0; ++j) want = std::max(want, o[c - j]);
        EXPECT_EQ(got[h * stride + c], want) << "successors " << succ << " head " << h << " chunk " << c;
      }
    }
    EXPECT_EQ(got[5], -kInf);
    EXPECT_EQ(got[6], -kInf);
    EXPECT_EQ(got[stride + 20], -kInf);
    EXPECT_EQ(got[7], std::max(own[7], succ >= 3 ? own[4] : -kInf));  // nothing from the excluded 5 and 6
  }
}

// landmarks_per_chunk S: the landmark rows are scored as chunks are (one
// softmax over every row of the selectable chunks) and a chunk scores as its
// best row. So S rows per chunk over n chunks give, per chunk, the maximum of
// the scores of S = 1 over n * S "chunks" (the rows, each excluded with its
// chunk), bit for bit; the same holds with an attached prefix's landmarks
// (shared_chunks) and for the statistics of context parallel's first call.
TEST(ShadowkvScoreCpu, SeveralLandmarksPerChunkScoreAChunkAsItsBestRow) {
  std::mt19937 rng(12);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int hkv = 2, group = 3, hq = hkv * group, d = 16, n = 37, cap = 41;
  for (int S : {2, 4}) {
    for (int shared : {0, 9}) {
      SCOPED_TRACE("S " + std::to_string(S) + " shared " + std::to_string(shared));
      const int rows = cap * S;
      std::vector<float> q(static_cast<size_t>(hq) * d);
      for (auto& x : q) x = nd(rng);
      // Rows below shared * S in the prefix's array, the rest in the sequence's.
      std::vector<float> pre(static_cast<size_t>(hkv) * std::max(shared, 1) * S * d),
          own(static_cast<size_t>(hkv) * (cap - shared) * S * d);
      for (auto& x : pre) x = nd(rng);
      for (auto& x : own) x = nd(rng);
      std::vector<uint8_t> excl(static_cast<size_t>(hkv) * cap, 0), row_excl(static_cast<size_t>(hkv) * rows, 0);
      for (int i : {3, 20, cap + 8}) excl[i] = 1;
      for (int h = 0; h < hkv; ++h)
        for (int v = 0; v < rows; ++v) row_excl[h * rows + v] = excl[h * cap + v / S];
      const float* pre_p = pre.data();
      const float* own_p = own.data();
      const uint8_t* e_p = excl.data();
      const uint8_t* re_p = row_excl.data();
      int32_t chunks = n, row_count = n * S;
      auto args = [&](bool as_rows, float* out, int64_t stride) {
        ShadowkvScoreArgs a;
        a.q = q.data();
        a.landmarks = &own_p;
        a.shared_landmarks = &pre_p;
        a.excluded = as_rows ? &re_p : &e_p;
        a.n_chunks = as_rows ? &row_count : &chunks;
        a.batch = 1;
        a.hq = hq;
        a.hkv = hkv;
        a.d = d;
        a.chunk_cap = as_rows ? rows : cap;
        a.landmark_cap = as_rows ? (cap - shared) * S : cap - shared;
        a.shared_chunks = as_rows ? shared * S : shared;
        a.max_chunks = as_rows ? rows : cap;
        a.landmarks_per_chunk = as_rows ? 1 : S;
        a.scale = 0.25f;
        a.scores = out;
        a.score_stride = stride;
        return a;
      };
      std::vector<float> got(static_cast<size_t>(hkv) * cap, 9.0f), per_row(static_cast<size_t>(hkv) * rows, 9.0f);
      ShadowkvScore(args(false, got.data(), cap));
      ShadowkvScore(args(true, per_row.data(), rows));
      for (int h = 0; h < hkv; ++h)
        for (int c = 0; c < cap; ++c) {
          float want = -kInf;
          if (c < n)
            for (int j = 0; j < S; ++j) want = std::max(want, per_row[h * rows + c * S + j]);
          EXPECT_EQ(got[h * cap + c], want) << "head " << h << " chunk " << c;
        }
      EXPECT_EQ(got[3], -kInf);
      EXPECT_EQ(got[cap + 8], -kInf);
      // The statistics of a first call (context parallel).
      std::vector<float> st(2 * hq, 0.0f), st_rows(2 * hq, 1.0f);
      ShadowkvScoreArgs a = args(false, got.data(), cap), b = args(true, per_row.data(), rows);
      a.stats_out = st.data();
      b.stats_out = st_rows.data();
      ShadowkvScore(a);
      ShadowkvScore(b);
      EXPECT_EQ(st, st_rows);
    }
  }
}

TEST(ShadowkvScoreCpu, AllExcludedGivesMinusInf) {
  std::vector<float> q(4, 1.0f), land(3 * 4, 1.0f), scores(3, 0.0f);
  std::vector<uint8_t> excl(3, 1);
  const float* lp = land.data();
  const uint8_t* ep = excl.data();
  int32_t n = 3;
  ShadowkvScoreArgs a;
  a.q = q.data();
  a.landmarks = &lp;
  a.excluded = &ep;
  a.n_chunks = &n;
  a.batch = a.hq = a.hkv = 1;
  a.d = 4;
  a.chunk_cap = a.max_chunks = 3;
  a.scores = scores.data();
  a.score_stride = 3;
  ShadowkvScore(a);
  for (float s : scores) EXPECT_EQ(s, -kInf);
}

// ---- slot update (model-based) ---------------------------------------------

struct SlotRun {
  int batch = 2, hkv = 3, ks = 16, cap = 100;
  std::vector<std::vector<int32_t>> maps;
  std::vector<int32_t> miss_count, miss_slot, miss_chunk;
  SlotRun() {
    maps.assign(batch, std::vector<int32_t>(static_cast<size_t>(hkv) * ks, -1));
    miss_count.assign(batch * hkv, -5);
    miss_slot.assign(static_cast<size_t>(batch) * hkv * ks, -5);
    miss_chunk.assign(static_cast<size_t>(batch) * hkv * ks, -5);
  }
  void Update(const std::vector<int32_t>& selection, float force_keep) {
    std::vector<int32_t*> mp;
    for (auto& m : maps) mp.push_back(m.data());
    ShadowkvSlotUpdateArgs a;
    a.selection = selection.data();
    a.selection_stride = ks;
    a.slot_maps = mp.data();
    a.miss_count = miss_count.data();
    a.miss_slot = miss_slot.data();
    a.miss_chunk = miss_chunk.data();
    a.batch = batch;
    a.hkv = hkv;
    a.kslots = ks;
    a.chunk_cap = cap;
    a.force_keep = force_keep;
    ShadowkvSlotUpdate(a);
  }
  int32_t* Map(int row) { return maps[row / hkv].data() + (row % hkv) * ks; }
};

// A random selection per row: `n` distinct chunk ids ascending, -1 padded;
// roughly `overlap` of them drawn from `prev`.
std::vector<int32_t> RandomSelection(std::mt19937& rng, const SlotRun& run, const std::vector<std::set<int32_t>>& prev,
                                     double overlap, int n) {
  std::vector<int32_t> sel(static_cast<size_t>(run.batch) * run.hkv * run.ks, -1);
  for (int row = 0; row < run.batch * run.hkv; ++row) {
    std::set<int32_t> s;
    std::vector<int32_t> p(prev[row].begin(), prev[row].end());
    std::shuffle(p.begin(), p.end(), rng);
    for (int32_t c : p)
      if (static_cast<int>(s.size()) < n && std::uniform_real_distribution<double>(0, 1)(rng) < overlap) s.insert(c);
    while (static_cast<int>(s.size()) < n) s.insert(static_cast<int32_t>(rng() % run.cap));
    int i = 0;
    for (int32_t c : s) sel[row * run.ks + i++] = c;
  }
  return sel;
}

// Context parallel: a sequence's chunks split into parts (shards), each
// scored in two calls around the exchange of the heads' statistics, gives
// each chunk the score it has when the whole sequence is scored at once; the
// proposals' scores are the selected chunks' scores.
TEST(ShadowkvScoreCpu, TwoCallsOverPartsEqualOneCallOverTheWhole) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int hkv = 2, group = 3, hq = hkv * group, d = 16, n = 90, k = 5;
  const float scale = 0.25f;
  std::vector<float> q(static_cast<size_t>(hq) * d), land(static_cast<size_t>(hkv) * n * d);
  std::vector<uint8_t> excl(static_cast<size_t>(hkv) * n);
  for (auto& x : q) x = nd(rng);
  for (auto& x : land) x = nd(rng);
  for (auto& x : excl) x = (rng() % 7) == 0;
  OneSequenceScore one;
  auto score = [&](const float* l, const uint8_t* e, int cap, int chunks, float* out, int64_t stride) {
    return one.Args(q.data(), hq, hkv, d, scale, l, e, cap, chunks, chunks, out, stride);
  };
  // The whole sequence at once.
  std::vector<float> whole(static_cast<size_t>(hkv) * n);
  ShadowkvScore(score(land.data(), excl.data(), n, n, whole.data(), n));
  // Parts [0, 20), [20, 64), [64, 90), each with its own landmark rows.
  const std::vector<int> cut = {0, 20, 64, n};
  const int parts = static_cast<int>(cut.size()) - 1;
  std::vector<std::vector<float>> pl(parts);
  std::vector<std::vector<uint8_t>> pe(parts);
  std::vector<float> stats(static_cast<size_t>(parts) * hq * 2, 99.0f);
  for (int p = 0; p < parts; ++p) {
    const int m = cut[p + 1] - cut[p];
    for (int h = 0; h < hkv; ++h) {
      pl[p].insert(pl[p].end(), land.begin() + (static_cast<size_t>(h) * n + cut[p]) * d,
                   land.begin() + (static_cast<size_t>(h) * n + cut[p + 1]) * d);
      pe[p].insert(pe[p].end(), excl.begin() + h * n + cut[p], excl.begin() + h * n + cut[p + 1]);
    }
    std::vector<float> untouched(static_cast<size_t>(hkv) * m, 5.0f);
    ShadowkvScoreArgs a = score(pl[p].data(), pe[p].data(), m, m, untouched.data(), m);
    a.stats_out = stats.data() + static_cast<size_t>(p) * hq * 2;
    ShadowkvScore(a);
    for (float x : untouched) ASSERT_EQ(x, 5.0f) << "a statistics call wrote scores";
  }
  for (int p = 0; p < parts; ++p) {
    const int m = cut[p + 1] - cut[p];
    std::vector<float> got(static_cast<size_t>(hkv) * m);
    ShadowkvScoreArgs a = score(pl[p].data(), pe[p].data(), m, m, got.data(), m);
    a.stats_in = stats.data();
    a.stats_parts = parts;
    a.stats_part_stride = hq * 2;
    ShadowkvScore(a);
    for (int h = 0; h < hkv; ++h)
      for (int c = 0; c < m; ++c) {
        const float w = whole[static_cast<size_t>(h) * n + cut[p] + c], g = got[static_cast<size_t>(h) * m + c];
        if (w == -kInf) {
          EXPECT_EQ(g, -kInf);
        } else {
          EXPECT_NEAR(g, w, 1e-6f + 1e-5f * w) << "part " << p << " head " << h << " chunk " << c;
        }
      }
    // The proposals' scores.
    std::vector<int32_t> sel(static_cast<size_t>(hkv) * (k + 2));
    TopKArgs t;
    t.values = got.data();
    t.stride = m;
    t.rows = hkv;
    t.uniform_count = m;
    t.k = k;
    t.skip_worst_inf = true;
    t.out = sel.data();
    t.out_stride = k + 2;
    TopK(t);
    std::vector<float> ss(sel.size(), 1.0f);
    SelectionScores(got.data(), m, sel.data(), k + 2, hkv, k, ss.data());
    for (int h = 0; h < hkv; ++h)
      for (int i = 0; i < k + 2; ++i) {
        const int32_t c = i < k ? sel[h * (k + 2) + i] : -1;
        EXPECT_EQ(ss[h * (k + 2) + i], c >= 0 ? got[static_cast<size_t>(h) * m + c] : -kInf);
      }
  }
}

// The global selection: every rank, from the same all-gathered proposals,
// keeps its own winners; together they are the top-k of all the proposals
// (ties to the lower part), and a rank's selection is ascending then -1.
TEST(ShadowkvGlobalSelectCpu, RanksKeepTheirWinnersOfOneTopK) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> small(0, 9);
  for (int parts : {1, 2, 3}) {
    for (int k : {1, 4, 9, 40}) {
      const int rows = 5, cs = 6;  // cand_stride
      const int64_t part_stride = rows * cs + 3;
      std::vector<float> cand(static_cast<size_t>(parts) * part_stride, 77.0f);
      std::vector<std::vector<int32_t>> prop(parts, std::vector<int32_t>(static_cast<size_t>(rows) * cs));
      for (int p = 0; p < parts; ++p)
        for (int r = 0; r < rows; ++r) {
          // Row 0: part 0 proposes nothing; row 1: every part proposes 2.
          const int have = r == 0 && p == 0 ? 0 : r == 1 ? 2 : cs - (r + p) % 3;
          for (int i = 0; i < cs; ++i) {
            const bool on = i < have;
            prop[p][r * cs + i] = on ? 1000 * p + 10 * i + r : -1;
            cand[p * part_stride + r * cs + i] = on ? static_cast<float>(small(rng)) / 10.0f : -kInf;  // ties
          }
        }
      std::vector<std::vector<int32_t>> got(parts);
      for (int rank = 0; rank < parts; ++rank) {
        const int len = cs + 1;
        std::vector<int32_t> winners(static_cast<size_t>(rows) * k, 55);
        got[rank].assign(static_cast<size_t>(rows) * (len + 1), 66);
        ShadowkvGlobalSelectArgs a;
        a.candidates = cand.data();
        a.parts = parts;
        a.rank = rank;
        a.part_stride = part_stride;
        a.rows = rows;
        a.cand_stride = cs;
        a.k = k;
        a.proposals = prop[rank].data();
        a.winners = winners.data();
        a.selection = got[rank].data();
        a.selection_stride = len + 1;
        a.selection_len = len;
        ShadowkvGlobalSelect(a);
        for (int r = 0; r < rows; ++r) EXPECT_EQ(got[rank][r * (len + 1) + len], 66) << "wrote past selection_len";
      }
      for (int r = 0; r < rows; ++r) {
        // The model: the top-k of (score, part, index) over all proposals.
        std::vector<std::tuple<float, int, int>> all;
        for (int p = 0; p < parts; ++p)
          for (int i = 0; i < cs; ++i)
            if (cand[p * part_stride + r * cs + i] != -kInf) all.emplace_back(cand[p * part_stride + r * cs + i], p, i);
        std::stable_sort(all.begin(), all.end(),
                         [](const auto& x, const auto& y) { return std::get<0>(x) > std::get<0>(y); });
        all.resize(std::min<size_t>(all.size(), k));
        for (int rank = 0; rank < parts; ++rank) {
          std::vector<int32_t> want;
          for (const auto& [v, p, i] : all)
            if (p == rank) want.push_back(prop[p][r * cs + i]);
          std::sort(want.begin(), want.end());
          want.resize(cs + 1, -1);
          const std::vector<int32_t> sel(got[rank].begin() + r * (cs + 2), got[rank].begin() + r * (cs + 2) + cs + 1);
          EXPECT_EQ(sel, want) << "parts " << parts << " k " << k << " rank " << rank << " row " << r;
        }
      }
    }
  }
}

TEST(ShadowkvSlotUpdateCpu, MapHoldsSelectionHitsStayMissesFillFreeSlots) {
  std::mt19937 rng(3);
  SlotRun run;
  const int rows = run.batch * run.hkv;
  std::vector<std::set<int32_t>> model(rows);
  for (int step = 0; step < 60; ++step) {
    const int n = step % 7 == 3 ? run.ks / 2 : run.ks;  // sometimes fewer than kslots valid
    const auto sel = RandomSelection(rng, run, model, 0.6, n);
    std::vector<std::vector<int32_t>> before(rows);
    for (int row = 0; row < rows; ++row) before[row].assign(run.Map(row), run.Map(row) + run.ks);
    run.Update(sel, -1.0f);
    for (int row = 0; row < rows; ++row) {
      std::set<int32_t> want;
      for (int i = 0; i < run.ks; ++i)
        if (sel[row * run.ks + i] >= 0) want.insert(sel[row * run.ks + i]);
      const int32_t* map = run.Map(row);
      std::multiset<int32_t> got;
      for (int s = 0; s < run.ks; ++s)
        if (map[s] >= 0) got.insert(map[s]);
      ASSERT_EQ(std::multiset<int32_t>(want.begin(), want.end()), got) << "step " << step << " row " << row;
      // Hits never move.
      int hits = 0;
      for (int s = 0; s < run.ks; ++s)
        if (before[row][s] >= 0 && want.count(before[row][s])) {
          EXPECT_EQ(map[s], before[row][s]);
          ++hits;
        }
      // Miss lists: exactly the new chunks, each in the slot the map now shows.
      const int nm = run.miss_count[row];
      ASSERT_EQ(nm, static_cast<int>(want.size()) - hits) << "step " << step;
      if (step == 0) {
        EXPECT_EQ(nm, static_cast<int>(want.size()));
      }
      std::set<int32_t> missed;
      for (int i = 0; i < run.ks; ++i) {
        const int32_t sl = run.miss_slot[row * run.ks + i], ch = run.miss_chunk[row * run.ks + i];
        if (i >= nm) {
          EXPECT_EQ(sl, -1);
          EXPECT_EQ(ch, -1);
          continue;
        }
        ASSERT_GE(sl, 0);
        EXPECT_EQ(map[sl], ch);
        EXPECT_FALSE(model[row].count(ch));
        EXPECT_TRUE(before[row][sl] < 0 || !want.count(before[row][sl]));  // took a free slot
        if (i > 0) {
          EXPECT_GT(sl, run.miss_slot[row * run.ks + i - 1]);  // lowest free slots first
        }
        missed.insert(ch);
      }
      EXPECT_EQ(missed.size(), static_cast<size_t>(nm));
      model[row] = want;
    }
  }
}

TEST(ShadowkvSlotUpdateCpu, ForceKeepKeepsLowestSlotsThenNewChunks) {
  std::mt19937 rng(4);
  SlotRun run;
  const int rows = run.batch * run.hkv;
  std::vector<std::set<int32_t>> model(rows);
  const float fk = 0.6f;
  const int keep = static_cast<int>(std::lround(fk * run.ks));  // 10 of 16
  for (int step = 0; step < 20; ++step) {
    // Selections disjoint from the previous map: without force_keep no hits.
    const auto sel = RandomSelection(rng, run, model, 0.0, run.ks);
    std::vector<std::vector<int32_t>> before(rows);
    for (int row = 0; row < rows; ++row) before[row].assign(run.Map(row), run.Map(row) + run.ks);
    run.Update(sel, fk);
    for (int row = 0; row < rows; ++row) {
      const int32_t* map = run.Map(row);
      if (step == 0) {
        EXPECT_EQ(run.miss_count[row], run.ks);  // empty previous map: all misses
      } else {
        // The `keep` lowest slots keep their chunk; the rest are misses.
        for (int s = 0; s < keep; ++s) EXPECT_EQ(map[s], before[row][s]) << "step " << step << " slot " << s;
        EXPECT_EQ(run.miss_count[row], run.ks - keep);
        std::set<int32_t> selected(sel.begin() + row * run.ks, sel.begin() + (row + 1) * run.ks);
        std::vector<int32_t> first_new;
        for (int32_t c : selected)
          if (!model[row].count(c) && static_cast<int>(first_new.size()) < run.ks - keep) first_new.push_back(c);
        std::vector<int32_t> got(run.miss_chunk.begin() + row * run.ks,
                                 run.miss_chunk.begin() + row * run.ks + run.ks - keep);
        EXPECT_EQ(got, first_new);  // highest-ranked (first in selection order) new chunks
      }
      model[row].clear();
      for (int s = 0; s < run.ks; ++s)
        if (map[s] >= 0) model[row].insert(map[s]);
      EXPECT_EQ(model[row].size(), static_cast<size_t>(run.ks));
    }
  }
}

// ---- key rebuild and value fetch --------------------------------------------

TEST(ShadowkvRebuildKCpu, MatchesDoubleReference) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int batch = 2, hkv = 2, d = 64, r = 37, C = 8, ks = 6, O = 2, cap_chunks = 50;
  const int token_cap = cap_chunks * C, att_cap = O * C + ks * C + 16;
  std::vector<std::vector<float>> A(batch, std::vector<float>(static_cast<size_t>(token_cap) * r));
  std::vector<std::vector<float>> B(batch, std::vector<float>(static_cast<size_t>(hkv) * r * d));
  std::vector<std::vector<float>> K(batch, std::vector<float>(static_cast<size_t>(hkv) * att_cap * d, 7.0f));
  for (auto& v : A)
    for (auto& x : v) x = nd(rng);
  for (auto& v : B)
    for (auto& x : v) x = nd(rng) * 0.2f;
  std::vector<float> inv_freq(d / 2);
  for (int j = 0; j < d / 2; ++j) inv_freq[j] = std::pow(10000.0f, -2.0f * j / d);
  std::vector<int32_t> count = {3, 0, 6, 1}, slot(batch * hkv * ks, -1), chunk(batch * hkv * ks, -1);
  for (int row = 0; row < batch * hkv; ++row)
    for (int m = 0; m < count[row]; ++m) {
      slot[row * ks + m] = (m * 5 + row) % ks;
      chunk[row * ks + m] = static_cast<int32_t>(rng() % cap_chunks);
    }
  for (int row = 0; row < batch * hkv; ++row) {  // distinct slots per row
    std::set<int32_t> s(slot.begin() + row * ks, slot.begin() + row * ks + count[row]);
    ASSERT_EQ(s.size(), static_cast<size_t>(count[row]));
  }
  std::vector<int32_t> offset = {0, 1000};
  std::vector<const float*> ap = {A[0].data(), A[1].data()}, bp = {B[0].data(), B[1].data()};
  std::vector<float*> kp = {K[0].data(), K[1].data()};
  ShadowkvRebuildKArgs a;
  a.a = ap.data();
  a.b = bp.data();
  a.position_offset = offset.data();
  a.inv_freq = inv_freq.data();
  a.miss_count = count.data();
  a.miss_slot = slot.data();
  a.miss_chunk = chunk.data();
  a.miss_stride = ks;
  a.att_k = kp.data();
  a.att_head_stride = static_cast<int64_t>(att_cap) * d;
  a.outlier_rows = O * C;
  a.batch = batch;
  a.hkv = hkv;
  a.d = d;
  a.r = r;
  a.chunk_size = C;
  ShadowkvRebuildK(a);

  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < hkv; ++h) {
      const int row = b * hkv + h;
      std::vector<float> want(static_cast<size_t>(att_cap) * d, 7.0f);
      for (int m = 0; m < count[row]; ++m)
        for (int i = 0; i < C; ++i) {
          const int t = chunk[row * ks + m] * C + i;
          std::vector<double> x(d);
          for (int j = 0; j < d; ++j)
            for (int k = 0; k < r; ++k) x[j] += double(A[b][t * r + k]) * B[b][(h * r + k) * d + j];
          const double pos = t + offset[b];
          float* w = want.data() + (O * C + slot[row * ks + m] * C + i) * d;
          for (int j = 0; j < d / 2; ++j) {
            const double ang = static_cast<float>(pos) * inv_freq[j];
            w[j] = static_cast<float>(x[j] * std::cos(ang) - x[j + d / 2] * std::sin(ang));
            w[j + d / 2] = static_cast<float>(x[j + d / 2] * std::cos(ang) + x[j] * std::sin(ang));
          }
        }
      EXPECT_TRUE(
          testing::AllClose(K[b].data() + static_cast<size_t>(h) * att_cap * d, want.data(), want.size(), 1e-4f, 1e-4f))
          << "b " << b << " h " << h;
    }
}

TEST(ShadowkvFetchVCpu, FetchAndScatterCopyChunksToSlots) {
  const int batch = 1, hkv = 2, d = 8, C = 4, ks = 3, O = 1, cap = 5, att_cap = O * C + ks * C;
  std::vector<float> store(static_cast<size_t>(hkv) * cap * C * d);
  std::iota(store.begin(), store.end(), 0.0f);
  std::vector<int32_t> count = {2, 1}, slot = {2, 0, -1, 1, -1, -1}, chunk = {4, 1, -1, 3, -1, -1};
  for (bool staged : {false, true}) {
    std::vector<float> V(static_cast<size_t>(hkv) * att_cap * d, -1.0f);
    std::vector<float> staging;
    for (int row = 0; row < 2; ++row)
      for (int m = 0; m < count[row]; ++m) {
        const float* src = store.data() + (static_cast<size_t>(row) * cap + chunk[row * ks + m]) * C * d;
        staging.insert(staging.end(), src, src + C * d);
      }
    std::vector<int32_t> offsets = {0, 2};
    const float* sp = store.data();
    float* vp = V.data();
    ShadowkvFetchVArgs a;
    a.value_store = &sp;
    a.chunk_cap = cap;
    a.staging = staged ? staging.data() : nullptr;
    a.staging_offsets = offsets.data();
    a.miss_count = count.data();
    a.miss_slot = slot.data();
    a.miss_chunk = chunk.data();
    a.miss_stride = ks;
    a.att_v = &vp;
    a.att_head_stride = static_cast<int64_t>(att_cap) * d;
    a.outlier_rows = O * C;
    a.batch = batch;
    a.hkv = hkv;
    a.d = d;
    a.chunk_size = C;
    ShadowkvFetchV(a);
    std::vector<float> want(V.size(), -1.0f);
    for (int h = 0; h < hkv; ++h)
      for (int m = 0; m < count[h]; ++m)
        for (int e = 0; e < C * d; ++e)
          want[(static_cast<size_t>(h) * att_cap + O * C + slot[h * ks + m] * C) * d + e] =
              store[(static_cast<size_t>(h) * cap + chunk[h * ks + m]) * C * d + e];
    EXPECT_TRUE(testing::AllClose(V, want, 0.0f, 0.0f)) << "staged " << staged;
  }
}

}  // namespace
}  // namespace penumbra::kernels::cpu
