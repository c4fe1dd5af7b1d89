// The engine side of the ShadowKV reference check on the CPU backend: the
// exactness property (full rank and full budget give full attention), the
// landmarks, outliers, scores and selection against double-precision
// computations made here, the sparse attention set with a partial budget,
// the results file, and clear errors for bad inputs files.
#include "worker/bench/shadowkv_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <set>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/worker/shadowkv_check_test_util.h"
#include "worker/model/safetensors.h"

namespace penumbra::shadowkv_check {
namespace {

using testing::Attend;
using testing::MakeInputs;
using testing::RopedKeys;
using testing::SynthOptions;
using testing::WriteInputs;

std::string TempPath(const std::string& name) { return ::testing::TempDir() + "/skvcheck_" + name; }

Result<CheckResults> RunCpu(const CheckInputs& in) {
  BackendOptions bo;
  bo.device = "cpu";
  PENUMBRA_ASSIGN_OR_RETURN(auto backend, CreateBackend(bo));
  return RunShadowkvCheck(in, *backend);
}

// Landmark and min-cos of every chunk, in double, from the exact post-RoPE keys.
void Landmarks(const CheckInputs& in, const std::vector<double>& kr, std::vector<double>* lm,
               std::vector<double>* min_cos) {
  const int H = in.hkv, n = in.n_chunks(), C = in.chunk, d = in.d;
  lm->assign(static_cast<size_t>(H) * n * d, 0.0);
  min_cos->assign(static_cast<size_t>(H) * n, 2.0);
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < n; ++c) {
      double* m = lm->data() + (static_cast<size_t>(h) * n + c) * d;
      for (int i = 0; i < C; ++i) {
        const double* k = kr.data() + (static_cast<size_t>(h) * in.seq + c * C + i) * d;
        for (int x = 0; x < d; ++x) m[x] += k[x] / C;
      }
      double mn = 0;
      for (int x = 0; x < d; ++x) mn += m[x] * m[x];
      for (int i = 0; i < C; ++i) {
        const double* k = kr.data() + (static_cast<size_t>(h) * in.seq + c * C + i) * d;
        double dot = 0, kn = 0;
        for (int x = 0; x < d; ++x) dot += m[x] * k[x], kn += k[x] * k[x];
        (*min_cos)[static_cast<size_t>(h) * n + c] =
            std::min((*min_cos)[static_cast<size_t>(h) * n + c], dot / std::sqrt(mn * kn));
      }
    }
  }
}

// Checks everything that holds for any budget: landmarks, outliers (the O
// lowest min-cos), scores, selection = top-k of the engine's own scores, and
// `out` = attention over outliers + selected + local window computed here
// (exact when rank is full).
void CheckAgainstDouble(const CheckInputs& in, const CheckResults& r, double out_tol) {
  const int H = in.hkv, n = in.n_chunks(), C = in.chunk, d = in.d, O = in.outliers, K = in.kslots(), G = in.group();
  ASSERT_EQ(r.n_chunks, n);
  ASSERT_EQ(r.outliers, O);
  ASSERT_EQ(r.kslots, K);
  const auto kr = RopedKeys(in);
  std::vector<double> lm, min_cos;
  Landmarks(in, kr, &lm, &min_cos);
  std::vector<float> lm_f(lm.begin(), lm.end());
  EXPECT_TRUE(penumbra::testing::AllClose(r.landmarks, lm_f, 1e-5f, 1e-5f)) << "landmarks";

  std::vector<std::set<int>> outl(H);
  for (int h = 0; h < H; ++h) {
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return min_cos[static_cast<size_t>(h) * n + a] < min_cos[static_cast<size_t>(h) * n + b];
    });
    std::vector<int> want(order.begin(), order.begin() + O);
    std::sort(want.begin(), want.end());
    std::vector<int> got(r.outlier_ids.begin() + h * O, r.outlier_ids.begin() + (h + 1) * O);
    EXPECT_EQ(got, want) << "outliers of head " << h;
    outl[h] = std::set<int>(got.begin(), got.end());
  }

  for (int s = 0; s < in.steps; ++s) {
    for (int h = 0; h < H; ++h) {
      // Scores: max over the group of the softmax over non-outlier chunks.
      std::vector<double> want(n, 0.0);
      for (int j = h * G; j < (h + 1) * G; ++j) {
        const auto q =
            testing::Rope(in.q.data() + (static_cast<size_t>(s) * in.hq + j) * d, d, in.seq + s, in.inv_freq);
        std::vector<double> lg(n, -INFINITY);
        double mx = -INFINITY, sum = 0;
        for (int c = 0; c < n; ++c) {
          if (outl[h].count(c)) continue;
          double dot = 0;
          for (int x = 0; x < d; ++x) dot += q[x] * lm[(static_cast<size_t>(h) * n + c) * d + x];
          lg[c] = dot * in.scale;
          mx = std::max(mx, lg[c]);
        }
        for (int c = 0; c < n; ++c) sum += outl[h].count(c) ? 0.0 : std::exp(lg[c] - mx);
        for (int c = 0; c < n; ++c) {
          if (!outl[h].count(c)) want[c] = std::max(want[c], std::exp(lg[c] - mx) / sum);
        }
      }
      const float* got = r.scores.data() + (static_cast<size_t>(s) * H + h) * n;
      double kth = 0;
      std::vector<int> sel(r.selected.begin() + (static_cast<size_t>(s) * H + h) * K,
                           r.selected.begin() + (static_cast<size_t>(s) * H + h + 1) * K);
      const std::set<int> sel_set(sel.begin(), sel.end());
      ASSERT_EQ(sel_set.size(), static_cast<size_t>(K));
      ASSERT_TRUE(std::is_sorted(sel.begin(), sel.end()));
      for (int c = 0; c < n; ++c) {
        if (outl[h].count(c)) {
          EXPECT_TRUE(got[c] == 0.0f || got[c] == -INFINITY) << "outlier score " << got[c];
          EXPECT_FALSE(sel_set.count(c)) << "outlier chunk " << c << " selected";
          continue;
        }
        EXPECT_NEAR(got[c], want[c], 1e-5 * want[c] + 1e-7) << "score step " << s << " head " << h << " chunk " << c;
      }
      // Own top-k: every selected score >= every other selectable one,
      // ties to the lower chunk id.
      kth = INFINITY;
      for (int c : sel) kth = std::min<double>(kth, got[c]);
      for (int c = 0; c < n; ++c) {
        if (outl[h].count(c) || sel_set.count(c)) continue;
        EXPECT_LE(got[c], kth) << "chunk " << c << " not selected over a lower score";
        if (got[c] == kth) {
          EXPECT_GT(c, *std::max_element(sel.begin(), sel.end())) << "tie not broken to the lower id";
        }
      }
      // Output over outliers + selected + local window.
      std::vector<int> toks;
      for (int c = 0; c < n; ++c) {
        if (outl[h].count(c) || sel_set.count(c)) {
          for (int i = 0; i < C; ++i) toks.push_back(c * C + i);
        }
      }
      for (int t = n * C; t < in.seq; ++t) toks.push_back(t);
      for (int j = h * G; j < (h + 1) * G; ++j) {
        const auto want_out = Attend(in, kr, s, j, toks);
        std::vector<float> w(want_out.begin(), want_out.end());
        const float* o = r.out.data() + (static_cast<size_t>(s) * in.hq + j) * d;
        EXPECT_TRUE(
            penumbra::testing::AllClose(o, w.data(), d, static_cast<float>(out_tol), static_cast<float>(out_tol)))
            << "out step " << s << " query head " << j;
      }
    }
  }
}

class ExactnessTest : public ::testing::TestWithParam<int> {};

// Full rank and full budget: out equals full attention over all S tokens.
TEST_P(ExactnessTest, FullRankFullBudgetIsFullAttention) {
  SynthOptions o;  // S 200, hkv 2, group 2, d 64, chunk 8, W 16, rank 128 = hkv*d
  o.outliers = GetParam();
  const CheckInputs made = MakeInputs(o);
  const std::string path = TempPath("exact" + std::to_string(o.outliers) + ".safetensors");
  ASSERT_TRUE(WriteInputs(made, path).ok());
  auto in = ReadInputs(path);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->n_chunks(), 23);
  EXPECT_EQ(in->kslots(), 23 - o.outliers);
  auto r = RunCpu(*in);
  ASSERT_TRUE(r.ok()) << r.status();
  const auto kr = RopedKeys(*in);
  for (int s = 0; s < in->steps; ++s) {
    for (int j = 0; j < in->hq; ++j) {
      const auto full = Attend(*in, kr, s, j, {});
      std::vector<float> w(full.begin(), full.end());
      EXPECT_TRUE(penumbra::testing::AllClose(r->out.data() + (static_cast<size_t>(s) * in->hq + j) * in->d, w.data(),
                                              in->d, 1e-4f, 0.0f))
          << "step " << s << " query head " << j;
    }
  }
  // Every non-outlier chunk is selected.
  for (int s = 0; s < in->steps; ++s) {
    for (int h = 0; h < in->hkv; ++h) {
      std::set<int> want;
      for (int c = 0; c < 23; ++c) want.insert(c);
      for (int x = 0; x < o.outliers; ++x) want.erase(r->outlier_ids[h * o.outliers + x]);
      const auto* sel = r->selected.data() + (static_cast<size_t>(s) * in->hkv + h) * in->kslots();
      EXPECT_EQ(std::vector<int>(sel, sel + in->kslots()), std::vector<int>(want.begin(), want.end()));
    }
  }
  CheckAgainstDouble(*in, *r, 1e-4);
  std::remove(path.c_str());
}

INSTANTIATE_TEST_SUITE_P(Outliers, ExactnessTest, ::testing::Values(0, 1, 2));

// Partial budget, full rank: the attention set is outliers + the engine's
// selection + local window, across steps with a persistent slot map.
TEST(ShadowkvCheckTest, PartialBudgetAttendsOutliersSelectedAndLocal) {
  SynthOptions o;
  o.seq = 331;  // local tail 16 + (331 - 16) % 8 = 19 tokens
  o.hkv = 2;
  o.group = 3;
  o.outliers = 3;
  o.budget = 8 * 7 + 5;  // kslots 7; budget need not be a multiple of C
  o.steps = 5;
  o.structured = true;
  o.odd_chunks = {4, 11, 30};
  const CheckInputs in = MakeInputs(o);
  auto r = RunCpu(in);
  ASSERT_TRUE(r.ok()) << r.status();
  CheckAgainstDouble(in, *r, 1e-4);
  for (int h = 0; h < in.hkv; ++h) {
    EXPECT_EQ(std::vector<int>(r->outlier_ids.begin() + h * 3, r->outlier_ids.begin() + h * 3 + 3),
              (std::vector<int>{4, 11, 30}));
  }
}

// Low rank: the outputs stay finite and the selection well formed; the values
// are the comparator's business.
TEST(ShadowkvCheckTest, LowRankRunsAndWritesResults) {
  SynthOptions o;
  o.rank = 16;
  o.outliers = 2;
  o.budget = 64;
  o.structured = true;
  const CheckInputs in = MakeInputs(o);
  auto r = RunCpu(in);
  ASSERT_TRUE(r.ok()) << r.status();
  for (float x : r->out) ASSERT_TRUE(std::isfinite(x));
  const std::string path = TempPath("results.safetensors");
  ASSERT_TRUE(WriteResults(*r, path).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata().at("dtype"), "f32");
  const std::vector<std::pair<std::string, std::vector<int64_t>>> want = {{"landmarks", {2, 23, 64}},
                                                                          {"outliers", {2, 2}},
                                                                          {"selected", {3, 2, 8}},
                                                                          {"out", {3, 4, 64}},
                                                                          {"scores", {3, 2, 23}}};
  for (const auto& [name, shape] : want) {
    const TensorInfo* t = f->Find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->shape, shape) << name;
    EXPECT_EQ(t->dtype_name, name == "outliers" || name == "selected" ? "I32" : "F32") << name;
  }
  std::vector<int32_t> sel(r->selected.size());
  std::memcpy(sel.data(), f->Find("selected")->data, sel.size() * 4);
  EXPECT_EQ(sel, r->selected);
  std::remove(path.c_str());
}

// Zero outliers: the results file holds an empty [hkv, 0] tensor.
TEST(ShadowkvCheckTest, ZeroOutliersWritesEmptyTensor) {
  SynthOptions o;
  o.budget = 16;
  const CheckInputs in = MakeInputs(o);
  auto r = RunCpu(in);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string path = TempPath("empty.safetensors");
  ASSERT_TRUE(WriteResults(*r, path).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->Find("outliers")->shape, (std::vector<int64_t>{2, 0}));
  std::remove(path.c_str());
}

struct BadCase {
  std::string what;
  std::string skip;
  std::map<std::string, std::string> meta;
  std::string expect;  // in the message
};

TEST(ShadowkvCheckTest, BadInputsGetClearErrors) {
  const CheckInputs in = MakeInputs(SynthOptions{});
  const std::vector<BadCase> cases = {
      {"missing v", "v", {}, "missing tensor 'v'"},
      {"missing inv_freq", "inv_freq", {}, "missing tensor 'inv_freq'"},
      {"missing rank", "", {{"rank", ""}}, "missing metadata key 'rank'"},
      {"bad chunk", "", {{"chunk", "8x"}}, "'chunk'"},
      {"budget too large", "", {{"budget", "1000"}}, "'budget'"},
      {"budget zero", "", {{"budget", "4"}}, "'budget'"},
      {"outliers too many", "", {{"outliers", "23"}}, "'outliers'"},
      {"rank too large", "", {{"rank", "129"}}, "'rank'"},
      {"no chunks", "", {{"local_window", "199"}}, "no chunks"},
      {"steps mismatch", "", {{"steps", "4"}}, "'steps'"},
      {"bad scale", "", {{"scale", "nan"}}, "'scale'"},
      {"bad format", "", {{"format", "something/2"}}, "'format'"},
  };
  const std::string path = TempPath("bad.safetensors");
  for (const BadCase& c : cases) {
    ASSERT_TRUE(WriteInputs(in, path, c.skip, c.meta).ok()) << c.what;
    auto r = ReadInputs(path);
    ASSERT_FALSE(r.ok()) << c.what;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.what << ": " << r.status();
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << c.what << ": " << r.status();
  }
  // Wrong dtype and shape.
  {
    std::vector<int32_t> ints(in.inv_freq.size());
    std::vector<OutTensor> t = {{"k_pre", DType::kF32, {2, 200, 64}, in.k_pre.data()},
                                {"v", DType::kF32, {2, 200, 64}, in.v.data()},
                                {"q", DType::kF32, {3, 4, 64}, in.q.data()},
                                {"inv_freq", DType::kI32, {32}, ints.data()}};
    ASSERT_TRUE(WriteSafetensors(path, t, {}).ok());
    auto r = ReadInputs(path);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("'inv_freq' is I32"), std::string::npos) << r.status();
    t[3] = {"inv_freq", DType::kF32, {32}, in.inv_freq.data()};
    t[2] = {"q", DType::kF32, {3, 8, 32}, in.q.data()};
    ASSERT_TRUE(WriteSafetensors(path, t, {}).ok());
    r = ReadInputs(path);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("'q'"), std::string::npos) << r.status();
  }
  // An engine limit.
  {
    CheckInputs big = in;
    big.chunk = 100;
    big.local_window = 0;
    big.budget = 100;
    const Status s = ValidateInputs(big);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("unsupported by the engine"), std::string::npos) << s;
  }
  // Not a safetensors file.
  {
    FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fputs("not safetensors", f);
    std::fclose(f);
    EXPECT_FALSE(ReadInputs(path).ok());
    EXPECT_FALSE(ReadInputs(path + ".does-not-exist").ok());
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace penumbra::shadowkv_check
