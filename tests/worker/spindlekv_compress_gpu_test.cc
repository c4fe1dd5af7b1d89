// CUDA SpindleKV window scores and selection (kernels/spindlekv_compress.cuh)
// against the host math they implement (worker/engine/spindlekv_math.h).
// Window scores: the same dtype-rounded queries and keys on both sides, every
// score compared with a relative tolerance (f32 row sums on the device, f64 on
// the host); f32 and bf16, pools 1, 4 and 7, head sizes that are and are not
// multiples of 32, more window rows than a block takes at once, a causal cut
// (rows that see part of the keys, one that sees none, one past the end),
// and the Llama shape. Selection: the host's scores uploaded as they are, so
// held counts, positions and masks must match exactly; distinct scores, many
// ties, NaN, infinities and signed zeros, keep 0, 1, context - 1 and >=
// context (no scores), no window, no context, 32 query heads a KV head.
// Outputs and workspaces are poisoned first. With PENUMBRA_KERNEL_BENCH=1 the
// Llama shape at 124928 tokens is timed.
//
// It lives under tests/worker/ because the host math is in penumbra_engine,
// which only these tests link.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <future>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/dtype.h"
#include "kernels/spindlekv_compress.cuh"
#include "tests/gpu_test_util.h"
#include "worker/engine/spindlekv_math.h"

namespace penumbra::kernels {
namespace {

using ::penumbra::testing::DownloadAs;
using ::penumbra::testing::GpuBuffer;
using ::penumbra::testing::KernelBenchEnabled;
using ::penumbra::testing::TimeMs;
using ::penumbra::testing::Upload;
using ::penumbra::testing::UploadAs;

template <typename T>
std::vector<T> Download(const GpuBuffer& b, size_t n) {
  return ::penumbra::testing::Download<T>(b.get(), n);
}

// A buffer of `bytes` filled with 0xff (NaN as floats, -1 as ints, every bit as masks).
GpuBuffer Poisoned(size_t bytes) {
  GpuBuffer b(bytes);
  CHECK(cudaMemset(b.get(), 0xff, std::max<size_t>(bytes, 1)) == cudaSuccess);
  return b;
}

// ---- window scores ----------------------------------------------------------

struct ScoreCase {
  std::string name;
  int hq, hkv, d, w;
  int64_t n;
  int pool;
  DType dtype;
  std::vector<int32_t> q_pos;  // empty: the last w tokens, n - w .. n - 1
};

struct ScoreInputs {
  std::vector<float> q, k;  // [w][hq][d] and [hkv][stride], as the device holds them
  std::vector<int32_t> q_pos;
  int64_t stride = 0;
  float scale = 1.0f;
  std::optional<GpuBuffer> q_dev, k_dev, pos_dev;  // GpuBuffer has no assignment
};

ScoreInputs MakeScoreInputs(const ScoreCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  ScoreInputs in;
  in.stride = c.n * c.d + 3;  // a head stride that is not n * d
  in.scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  std::vector<float> q(static_cast<size_t>(c.w) * c.hq * c.d), k(static_cast<size_t>(c.hkv) * in.stride);
  for (float& x : q) x = normal(rng);
  for (float& x : k) x = normal(rng);
  // A few keys far more attended than the rest, so that the scores span several orders of magnitude.
  for (int g = 0; g < c.hkv; ++g) {
    for (int i = 0; i < 8; ++i) {
      const int64_t t = static_cast<int64_t>(rng() % c.n);
      for (int e = 0; e < c.d; ++e) k[g * in.stride + t * c.d + e] *= 3.0f;
    }
  }
  in.q_dev.emplace(UploadAs(q, c.dtype, &in.q));
  in.k_dev.emplace(UploadAs(k, c.dtype, &in.k));
  in.q_pos = c.q_pos;
  if (in.q_pos.empty()) {
    for (int b = 0; b < c.w; ++b) in.q_pos.push_back(static_cast<int32_t>(c.n - c.w + b));
  }
  in.pos_dev.emplace(Upload(in.q_pos));
  return in;
}

// spindlekv::WindowScores for every query head, [hq][n].
std::vector<float> HostWindowScores(const ScoreCase& c, const ScoreInputs& in) {
  std::vector<float> out(static_cast<size_t>(c.hq) * c.n);
  const int group = c.hq / c.hkv;
  std::vector<std::future<void>> jobs;
  for (int h = 0; h < c.hq; ++h) {
    jobs.push_back(std::async(std::launch::async, [&, h] {
      std::vector<float> rows(static_cast<size_t>(c.w) * c.d);
      for (int b = 0; b < c.w; ++b) {
        std::memcpy(&rows[static_cast<size_t>(b) * c.d], &in.q[(static_cast<size_t>(b) * c.hq + h) * c.d],
                    sizeof(float) * c.d);
      }
      spindlekv::WindowScores(rows.data(), in.q_pos.data(), c.w, &in.k[(h / group) * in.stride], c.n, c.d, in.scale,
                              c.pool, &out[static_cast<size_t>(h) * c.n]);
    }));
  }
  for (auto& j : jobs) j.get();
  return out;
}

SpindlekvWindowScoresArgs ScoreArgs(const ScoreCase& c, const ScoreInputs& in, float* out, float* workspace) {
  SpindlekvWindowScoresArgs a;
  a.q = in.q_dev->get();
  a.q_pos = in.pos_dev->as<int32_t>();
  a.k = in.k_dev->get();
  a.head_stride = in.stride;
  a.dtype = c.dtype;
  a.w = c.w;
  a.hq = c.hq;
  a.hkv = c.hkv;
  a.d = c.d;
  a.n = c.n;
  a.scale = in.scale;
  a.pool = c.pool;
  a.out = out;
  a.workspace = workspace;
  return a;
}

void CheckWindowScores(const ScoreCase& c) {
  SCOPED_TRACE(c.name + (c.dtype == DType::kBF16 ? " bf16" : " f32") + " pool " + std::to_string(c.pool));
  ASSERT_TRUE(SpindlekvWindowScoresSupported(c.d));
  const ScoreInputs in = MakeScoreInputs(c, static_cast<uint32_t>(c.n * 31 + c.d + c.w + c.pool));
  const std::vector<float> want = HostWindowScores(c, in);
  GpuBuffer out = Poisoned(want.size() * sizeof(float));
  SpindlekvWindowScoresArgs a = ScoreArgs(c, in, out.as<float>(), nullptr);
  GpuBuffer ws = Poisoned(SpindlekvWindowScoresWorkspaceFloats(a) * sizeof(float));
  a.workspace = ws.as<float>();
  PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
  LaunchSpindlekvWindowScores(a, nullptr);
  PENUMBRA_CUDA_OK(cudaGetLastError());
  PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = Download<float>(out, want.size());
  // f32 logits in another order and f32 row sums: a few 1e-6 relative; 1e-4 leaves room for bf16 inputs'
  // larger logits without hiding a wrong row or key (each is a whole probability).
  constexpr double kRel = 1e-4, kAbs = 1e-12;
  int64_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = want[i], g = got[i];
    if (std::fabs(g - w) <= kRel * std::fabs(w) + kAbs) continue;
    if (bad++ == 0) {
      ADD_FAILURE() << "first bad score: head " << i / c.n << " token " << i % c.n << ": got " << g << " want " << w;
    }
  }
  EXPECT_EQ(bad, 0) << "of " << want.size();
}

TEST(SpindlekvWindowScoresGpu, MatchesTheHostMath) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (int pool : {7, 1, 4}) {
      CheckWindowScores({"small", 4, 1, 64, 8, 300, pool, dt, {}});
    }
    // A causal cut: rows that see part of the keys, one that sees none, one that sees past the end.
    CheckWindowScores({"causal", 4, 2, 64, 8, 300, 7, dt, {-1, 3, 40, 127, 128, 200, 299, 400}});
    CheckWindowScores({"causal", 4, 2, 64, 8, 300, 1, dt, {-1, 3, 40, 127, 128, 200, 299, 400}});
    // Head sizes that are no multiple of 32, a single key, fewer keys than window rows.
    CheckWindowScores({"d40", 6, 3, 40, 5, 1000, 3, dt, {}});
    CheckWindowScores({"d200", 2, 1, 200, 4, 129, 7, dt, {}});
    CheckWindowScores({"one key", 2, 1, 64, 1, 1, 7, dt, {0}});
    CheckWindowScores({"short", 4, 1, 64, 40, 50, 5, dt, {}});
    // More rows than a block takes at once, and blocks that take several tiles of keys.
    CheckWindowScores({"w80", 4, 2, 128, 80, 3000, 7, dt, {}});
    CheckWindowScores({"llama", 32, 8, 128, 32, 20000, 7, dt, {}});
  }
}

TEST(SpindlekvWindowScoresGpu, NoWindowRowsGiveZeros) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  CheckWindowScores({"no rows", 4, 1, 64, 0, 300, 7, DType::kF32, {}});
}

// ---- select -----------------------------------------------------------------

// Runs the device selection and compares it with spindlekv::SelectHeld: the
// same held counts, positions and masks. scores may be empty when keep >=
// context (the device then gets no scores).
void CheckSelect(const std::string& name, const std::vector<float>& scores, int64_t n, int64_t context, int64_t keep,
                 int hq, int hkv) {
  SCOPED_TRACE(name + ": n " + std::to_string(n) + " context " + std::to_string(context) + " keep " +
               std::to_string(keep) + " hq " + std::to_string(hq) + " hkv " + std::to_string(hkv));
  std::vector<std::vector<int32_t>> want_pos;
  std::vector<std::vector<uint32_t>> want_heads;
  spindlekv::SelectHeld(scores.empty() ? nullptr : scores.data(), n, context, keep, hq, hkv, &want_pos, &want_heads);

  const GpuBuffer scores_dev = scores.empty() ? GpuBuffer(1) : Upload(scores);
  GpuBuffer held = Poisoned(hkv * sizeof(int32_t));
  GpuBuffer pos = Poisoned(static_cast<size_t>(hkv) * n * sizeof(int32_t));
  GpuBuffer heads = Poisoned(static_cast<size_t>(hkv) * n * sizeof(uint32_t));
  SpindlekvSelectArgs a;
  a.scores = scores.empty() ? nullptr : scores_dev.as<float>();
  a.n = n;
  a.context = context;
  a.keep = keep;
  a.hq = hq;
  a.hkv = hkv;
  a.held = held.as<int32_t>();
  a.pos = pos.as<int32_t>();
  a.heads = heads.as<uint32_t>();
  GpuBuffer ws = Poisoned(SpindlekvSelectWorkspaceBytes(a));
  a.workspace = ws.get();
  PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
  LaunchSpindlekvSelect(a, nullptr);
  PENUMBRA_CUDA_OK(cudaGetLastError());
  PENUMBRA_CUDA_OK(cudaDeviceSynchronize());

  const std::vector<int32_t> got_held = Download<int32_t>(held, hkv);
  const std::vector<int32_t> got_pos = Download<int32_t>(pos, static_cast<size_t>(hkv) * n);
  const std::vector<uint32_t> got_heads = Download<uint32_t>(heads, static_cast<size_t>(hkv) * n);
  for (int g = 0; g < hkv; ++g) {
    const auto& wp = want_pos[g];
    const auto& wh = want_heads[g];
    ASSERT_EQ(got_held[g], static_cast<int32_t>(wp.size())) << "KV head " << g;
    for (size_t i = 0; i < wp.size(); ++i) {
      const size_t at = static_cast<size_t>(g) * n + i;
      ASSERT_EQ(got_pos[at], wp[i]) << "KV head " << g << " held token " << i;
      ASSERT_EQ(got_heads[at], wh[i]) << "KV head " << g << " held token " << i << " (position " << wp[i] << ")";
    }
  }
}

enum class ScoreKind { kDistinct, kTies, kSpecial };

std::vector<float> RandomScores(size_t count, ScoreKind kind, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::vector<float> s(count);
  for (float& x : s) {
    const float u = uni(rng);
    switch (kind) {
      case ScoreKind::kDistinct:
        x = u * u * 1e-3f;  // small positive scores, like a window's attention
        break;
      case ScoreKind::kTies:
        x = std::floor(u * 5.0f) / 5.0f;  // five values: long runs of equal scores
        break;
      case ScoreKind::kSpecial: {
        const uint32_t r = rng() % 16;
        if (r == 0) {
          x = std::numeric_limits<float>::quiet_NaN();
        } else if (r == 1) {
          x = -std::numeric_limits<float>::quiet_NaN();
        } else if (r == 2) {
          x = 0.0f;
        } else if (r == 3) {
          x = -0.0f;
        } else if (r == 4) {
          x = std::numeric_limits<float>::infinity();
        } else if (r == 5) {
          x = -std::numeric_limits<float>::infinity();
        } else {
          x = std::floor((u - 0.5f) * 8.0f) / 4.0f;  // ties, negatives too
        }
        break;
      }
    }
  }
  return s;
}

TEST(SpindlekvSelectGpu, MatchesTheHostSelection) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  struct Shape {
    int hq, hkv;
    int64_t n, window;
  };
  for (const Shape& sh : {Shape{4, 1, 300, 8}, Shape{32, 8, 20000, 32}, Shape{32, 1, 5000, 32}, Shape{8, 2, 4097, 0}}) {
    const int64_t context = sh.n - sh.window;
    for (ScoreKind kind : {ScoreKind::kDistinct, ScoreKind::kTies, ScoreKind::kSpecial}) {
      const std::string name = kind == ScoreKind::kDistinct ? "distinct"
                               : kind == ScoreKind::kTies   ? "ties"
                                                            : "special";
      const std::vector<float> scores =
          RandomScores(static_cast<size_t>(sh.hq) * sh.n, kind, static_cast<uint32_t>(sh.n + sh.hq * 7));
      for (int64_t keep : {context / 3, int64_t{1}, context - 1, int64_t{0}, context / 2 + 1}) {
        CheckSelect(name, scores, sh.n, context, keep, sh.hq, sh.hkv);
      }
    }
    // Every context token kept: no scores needed.
    CheckSelect("all", {}, sh.n, context, context, sh.hq, sh.hkv);
    CheckSelect("all", {}, sh.n, context, context + 5, sh.hq, sh.hkv);
  }
  // No context: the window alone.
  CheckSelect("window only", {}, 40, 0, 0, 4, 2);
  CheckSelect("window only", RandomScores(4 * 40, ScoreKind::kDistinct, 1), 40, 0, 3, 4, 2);
  // Nothing at all.
  CheckSelect("empty", {}, 0, 0, 0, 4, 2);
}

// The window's scores from the host math (as the policy gets them), ranked on the device.
TEST(SpindlekvSelectGpu, RanksWindowScores) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const ScoreCase c{"llama", 32, 8, 128, 32, 20000, 7, DType::kBF16, {}};
  const ScoreInputs in = MakeScoreInputs(c, 5);
  const std::vector<float> scores = HostWindowScores(c, in);
  const int64_t context = c.n - c.w;
  for (int64_t keep : {context / 10, context / 2}) CheckSelect("window scores", scores, c.n, context, keep, 32, 8);
}

// With PENUMBRA_KERNEL_BENCH=1: the Llama shape at 124928 tokens, bf16.
TEST(SpindlekvCompressGpu, Bench) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  if (!KernelBenchEnabled()) GTEST_SKIP() << "PENUMBRA_KERNEL_BENCH=1 times it";
  const ScoreCase c{"llama", 32, 8, 128, 32, 124928, 7, DType::kBF16, {}};
  const ScoreInputs in = MakeScoreInputs(c, 9);
  GpuBuffer out(static_cast<size_t>(c.hq) * c.n * sizeof(float));
  SpindlekvWindowScoresArgs a = ScoreArgs(c, in, out.as<float>(), nullptr);
  GpuBuffer ws(SpindlekvWindowScoresWorkspaceFloats(a) * sizeof(float));
  a.workspace = ws.as<float>();
  const float score_ms = TimeMs([&] { LaunchSpindlekvWindowScores(a, nullptr); }, 5);
  PENUMBRA_CUDA_OK(cudaGetLastError());

  const int64_t context = c.n - c.w;
  GpuBuffer held(c.hkv * sizeof(int32_t)), pos(static_cast<size_t>(c.hkv) * c.n * sizeof(int32_t)),
      heads(static_cast<size_t>(c.hkv) * c.n * sizeof(uint32_t));
  SpindlekvSelectArgs s;
  s.scores = out.as<float>();
  s.n = c.n;
  s.context = context;
  s.keep = context / 5;
  s.hq = c.hq;
  s.hkv = c.hkv;
  s.held = held.as<int32_t>();
  s.pos = pos.as<int32_t>();
  s.heads = heads.as<uint32_t>();
  GpuBuffer sws(SpindlekvSelectWorkspaceBytes(s));
  s.workspace = sws.get();
  const float select_ms = TimeMs([&] { LaunchSpindlekvSelect(s, nullptr); }, 5);
  PENUMBRA_CUDA_OK(cudaGetLastError());
  std::printf(
      "spindlekv compress, hq %d hkv %d d %d w %d n %lld bf16: window scores %.3f ms, select (keep %lld) %.3f ms\n",
      c.hq, c.hkv, c.d, c.w, static_cast<long long>(c.n), score_ms, static_cast<long long>(s.keep), select_ms);
}

}  // namespace
}  // namespace penumbra::kernels
