// CUDA-vs-CPU parity for the pointwise ops: embedding, RMSNorm, RoPE + KV store,
// SwiGLU, bias add, dtype conversion and sampling. Random non-zero inputs,
// awkward sizes, every dtype the launchers take; outputs are poisoned with NaN
// bit patterns before each launch (so an unwritten element fails) and followed
// by a poisoned guard region that must stay untouched.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "common/dtype.h"
#include "kernels/add_bias.cuh"
#include "kernels/convert.cuh"
#include "kernels/cpu/ops.h"
#include "kernels/embedding.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope_store.cuh"
#include "kernels/sample.cuh"
#include "kernels/swiglu.cuh"
#include "tests/gpu_test_util.h"

namespace penumbra::kernels {
namespace {

using ::penumbra::testing::AllClose;

constexpr size_t kGuardBytes = 64;
constexpr uint8_t kPoison = 0xFF;  // NaN as f32, bf16 and f16

// Device buffer of `bytes` plus a poisoned guard; `offset` bytes into the
// allocation (to exercise unaligned fallbacks).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes, size_t offset = 0) : bytes_(bytes), offset_(offset) {
    total_ = offset + bytes + kGuardBytes;
    EXPECT_EQ(cudaMalloc(&base_, total_), cudaSuccess);
    Poison();
  }
  ~DeviceBuffer() { cudaFree(base_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return static_cast<uint8_t*>(base_) + offset_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(get());
  }
  void Poison() { EXPECT_EQ(cudaMemset(base_, kPoison, total_), cudaSuccess); }
  void Upload(const void* src) { EXPECT_EQ(cudaMemcpy(get(), src, bytes_, cudaMemcpyHostToDevice), cudaSuccess); }
  std::vector<uint8_t> DownloadAll() const {
    std::vector<uint8_t> h(total_);
    EXPECT_EQ(cudaMemcpy(h.data(), base_, total_, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  // The payload as f32 (converted from dtype); EXPECTs the guard is intact.
  std::vector<float> DownloadF32(DType dtype) const {
    const auto all = DownloadAll();
    for (size_t i = offset_ + bytes_; i < total_; ++i) {
      if (all[i] != kPoison) {
        ADD_FAILURE() << "write past the end at byte " << (i - offset_ - bytes_);
        break;
      }
    }
    const size_t n = bytes_ / DTypeSize(dtype);
    std::vector<float> out(n);
    ConvertToF32(all.data() + offset_, dtype, out.data(), n);
    return out;
  }

 private:
  void* base_ = nullptr;
  size_t bytes_, offset_, total_;
};

std::vector<float> RandomNonZero(size_t n, std::mt19937& rng, float lo = -2.0f, float hi = 2.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) {
    do x = u(rng);
    while (x == 0.0f);
  }
  return v;
}

// Host bytes of `v` in `dtype` (rounded), and `v` replaced by the rounded values.
std::vector<uint8_t> ToDType(std::vector<float>& v, DType dtype) {
  std::vector<uint8_t> bytes(v.size() * DTypeSize(dtype));
  ConvertFromF32(v.data(), bytes.data(), dtype, v.size());
  ConvertToF32(bytes.data(), dtype, v.data(), v.size());
  return bytes;
}

// Tolerance for an output of `dtype` compared with an f32 reference.
float RelTol(DType dtype, float f32_tol) {
  switch (dtype) {
    case DType::kBF16:
      return 8e-3f;
    case DType::kF16:
      return 1e-3f;
    default:
      return f32_tol;
  }
}

std::string Name(DType t) { return std::string(DTypeName(t)); }

#define EXPECT_LAUNCH_OK()                     \
  do {                                         \
    PENUMBRA_CUDA_OK(cudaGetLastError());      \
    PENUMBRA_CUDA_OK(cudaDeviceSynchronize()); \
  } while (0)

constexpr int kRows[] = {1, 7, 129, 1000};
constexpr int kDims[] = {8, 64, 200, 4096};
constexpr DType kFloatTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

TEST(EmbeddingGpuTest, MatchesCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  const int vocab = 1037;
  for (DType td : kFloatTypes) {
    for (int n : kRows) {
      for (int dim : kDims) {
        for (size_t off : {size_t{0}, size_t{4}}) {
          SCOPED_TRACE(Name(td) + " n=" + std::to_string(n) + " dim=" + std::to_string(dim) +
                       " offset=" + std::to_string(off));
          std::vector<float> table = RandomNonZero(static_cast<size_t>(vocab) * dim, rng);
          const auto table_bytes = ToDType(table, td);
          std::vector<int32_t> ids(n);
          std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
          for (auto& id : ids) id = pick(rng);
          ids[0] = vocab - 1;
          DeviceBuffer d_table(table_bytes.size(), off), d_ids(n * sizeof(int32_t)),
              d_out(static_cast<size_t>(n) * dim * sizeof(float), off);
          d_table.Upload(table_bytes.data());
          d_ids.Upload(ids.data());
          LaunchEmbedding(d_table.get(), td, d_ids.as<int32_t>(), n, dim, d_out.as<float>(), nullptr);
          EXPECT_LAUNCH_OK();
          std::vector<float> expect(static_cast<size_t>(n) * dim);
          cpu::Embedding(table.data(), ids.data(), n, dim, expect.data());
          EXPECT_TRUE(AllClose(d_out.DownloadF32(DType::kF32), expect, 0, 0));
        }
      }
    }
  }
}

TEST(RmsNormGpuTest, MatchesCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  std::mt19937 rng(12);
  const std::pair<DType, DType> combos[] = {{DType::kF32, DType::kF32},
                                            {DType::kBF16, DType::kF32},
                                            {DType::kBF16, DType::kBF16},
                                            {DType::kF16, DType::kF16},
                                            {DType::kF32, DType::kBF16}};
  for (auto [wd, od] : combos) {
    for (int n : kRows) {
      for (int dim : kDims) {
        SCOPED_TRACE(Name(wd) + "->" + Name(od) + " n=" + std::to_string(n) + " dim=" + std::to_string(dim));
        const auto x = RandomNonZero(static_cast<size_t>(n) * dim, rng, -3.0f, 3.0f);
        auto w = RandomNonZero(dim, rng, 0.1f, 2.0f);
        const auto w_bytes = ToDType(w, wd);
        DeviceBuffer d_x(x.size() * 4), d_w(w_bytes.size()), d_out(x.size() * DTypeSize(od));
        d_x.Upload(x.data());
        d_w.Upload(w_bytes.data());
        LaunchRmsNorm(d_x.as<float>(), d_w.get(), wd, n, dim, 1e-5f, d_out.get(), od, nullptr);
        EXPECT_LAUNCH_OK();
        std::vector<float> expect(x.size());
        cpu::RmsNorm(x.data(), w.data(), n, dim, 1e-5f, expect.data());
        EXPECT_TRUE(AllClose(d_out.DownloadF32(od), expect, 1e-6f, RelTol(od, 1e-5f)));
      }
    }
  }
  // Unaligned x (scalar path).
  const int n = 7, dim = 64;
  const auto x = RandomNonZero(n * dim, rng);
  auto w = RandomNonZero(dim, rng);
  DeviceBuffer d_x(x.size() * 4, 4), d_w(w.size() * 4), d_out(x.size() * 4);
  d_x.Upload(x.data());
  d_w.Upload(w.data());
  LaunchRmsNorm(d_x.as<float>(), d_w.get(), DType::kF32, n, dim, 1e-6f, d_out.get(), DType::kF32, nullptr);
  EXPECT_LAUNCH_OK();
  std::vector<float> expect(x.size());
  cpu::RmsNorm(x.data(), w.data(), n, dim, 1e-6f, expect.data());
  EXPECT_TRUE(AllClose(d_out.DownloadF32(DType::kF32), expect, 1e-6f, 1e-5f));
}

struct RopeCase {
  int n, hkv, group, d;
  DType q_dtype, kv_dtype;
  size_t qkv_offset = 0, cache_offset = 0;  // bytes, to force unaligned paths
  bool pre_rope = true;
};

void RunRopeCase(const RopeCase& c, std::mt19937& rng) {
  const int hq = c.hkv * c.group, d = c.d, n = c.n;
  SCOPED_TRACE("n=" + std::to_string(n) + " hq=" + std::to_string(hq) + " hkv=" + std::to_string(c.hkv) +
               " d=" + std::to_string(d) + " q=" + Name(c.q_dtype) + " kv=" + Name(c.kv_dtype) +
               " offsets=" + std::to_string(c.qkv_offset) + "/" + std::to_string(c.cache_offset));
  const int64_t row = static_cast<int64_t>(hq + 2 * c.hkv) * d;
  const auto qkv = RandomNonZero(n * row, rng);
  std::vector<int32_t> positions(n);
  std::uniform_int_distribution<int32_t> pos(0, 1 << 20);
  for (auto& p : positions) p = pos(rng);
  positions[0] = 0;
  if (n > 1) positions[n - 1] = (1 << 20) - 1;
  std::vector<float> inv_freq(d / 2);
  for (int i = 0; i < d / 2; ++i) inv_freq[i] = std::pow(500000.0f, -2.0f * static_cast<float>(i) / d);

  // Cache [hkv, slots, d]; token t goes to a scattered slot.
  const int slots = n + 5;
  const int64_t head_stride = static_cast<int64_t>(slots) * d;
  std::vector<int> slot(n);
  for (int t = 0; t < n; ++t) slot[t] = static_cast<int>((static_cast<int64_t>(t) * 7 + 3) % slots);
  {
    std::set<int> uniq(slot.begin(), slot.end());
    ASSERT_EQ(static_cast<int>(uniq.size()), n);  // slots % 7 != 0 keeps the map one-to-one
  }
  const size_t kvs = DTypeSize(c.kv_dtype);
  DeviceBuffer d_qkv(qkv.size() * 4, c.qkv_offset), d_pos(n * 4), d_freq(inv_freq.size() * 4),
      d_q(static_cast<size_t>(n) * hq * d * DTypeSize(c.q_dtype)), d_kc(c.hkv * head_stride * kvs, c.cache_offset),
      d_vc(c.hkv * head_stride * kvs, c.cache_offset), d_pre(static_cast<size_t>(n) * c.hkv * d * 4),
      d_kptr(n * sizeof(void*)), d_vptr(n * sizeof(void*)), d_pre_rows(static_cast<size_t>(n) * c.hkv * d * 4),
      d_pre_ptr(n * sizeof(void*));
  d_qkv.Upload(qkv.data());
  d_pos.Upload(positions.data());
  d_freq.Upload(inv_freq.data());
  std::vector<void*> kp(n), vp(n);
  for (int t = 0; t < n; ++t) {
    kp[t] = d_kc.as<uint8_t>() + static_cast<int64_t>(slot[t]) * d * kvs;
    vp[t] = d_vc.as<uint8_t>() + static_cast<int64_t>(slot[t]) * d * kvs;
  }
  d_kptr.Upload(kp.data());
  d_vptr.Upload(vp.data());
  // pre_rope_k_dst: token t's pre-RoPE keys to row n - 1 - t of another buffer.
  std::vector<float*> pre_rows(n);
  for (int t = 0; t < n; ++t) pre_rows[t] = d_pre_rows.as<float>() + static_cast<int64_t>(n - 1 - t) * c.hkv * d;
  d_pre_ptr.Upload(pre_rows.data());

  RopeStoreArgs a;
  a.qkv = d_qkv.as<float>();
  a.positions = d_pos.as<int32_t>();
  a.inv_freq = d_freq.as<float>();
  a.n = n, a.hq = hq, a.hkv = c.hkv, a.d = d;
  a.q_out = d_q.get();
  a.q_dtype = c.q_dtype;
  a.k_dst = d_kptr.as<void* const>();
  a.v_dst = d_vptr.as<void* const>();
  a.head_stride = head_stride;
  a.kv_dtype = c.kv_dtype;
  a.pre_rope_k_out = c.pre_rope ? d_pre.as<float>() : nullptr;
  a.pre_rope_k_dst = c.pre_rope ? d_pre_ptr.as<float* const>() : nullptr;
  LaunchRopeStore(a, nullptr);
  EXPECT_LAUNCH_OK();

  std::vector<float> eq(static_cast<size_t>(n) * hq * d), ekc(c.hkv * head_stride, std::nanf("")),
      evc(c.hkv * head_stride, std::nanf("")), epre(static_cast<size_t>(n) * c.hkv * d);
  std::vector<float*> ek(n), ev(n);
  for (int t = 0; t < n; ++t) {
    ek[t] = ekc.data() + static_cast<int64_t>(slot[t]) * d;
    ev[t] = evc.data() + static_cast<int64_t>(slot[t]) * d;
  }
  cpu::RopeStoreArgs ca;
  ca.qkv = qkv.data();
  ca.positions = positions.data();
  ca.inv_freq = inv_freq.data();
  ca.n = n, ca.hq = hq, ca.hkv = c.hkv, ca.d = d;
  ca.q_out = eq.data();
  ca.k_dst = ek.data();
  ca.v_dst = ev.data();
  ca.head_stride = head_stride;
  ca.pre_rope_k_out = epre.data();
  cpu::RopeStore(ca);

  EXPECT_TRUE(AllClose(d_q.DownloadF32(c.q_dtype), eq, 1e-5f, RelTol(c.q_dtype, 1e-5f))) << "q_out";
  if (c.pre_rope) {
    EXPECT_TRUE(AllClose(d_pre.DownloadF32(DType::kF32), epre, 0, 0)) << "pre_rope_k_out";
    const std::vector<float> rows = d_pre_rows.DownloadF32(DType::kF32);
    std::vector<float> unreversed(rows.size());
    const size_t w = static_cast<size_t>(c.hkv) * d;
    for (int t = 0; t < n; ++t) std::copy_n(rows.begin() + (n - 1 - t) * w, w, unreversed.begin() + t * w);
    EXPECT_TRUE(AllClose(unreversed, epre, 0, 0)) << "pre_rope_k_dst";
  }
  // Cache: written slots must match; every other slot must still be poison.
  for (int which = 0; which < 2; ++which) {
    const DeviceBuffer& buf = which == 0 ? d_kc : d_vc;
    const std::vector<float>& expect = which == 0 ? ekc : evc;
    const auto got = buf.DownloadF32(c.kv_dtype);
    std::vector<float> got_w, exp_w;
    size_t stray = 0;
    for (size_t i = 0; i < expect.size(); ++i) {
      if (std::isnan(expect[i])) {
        stray += !std::isnan(got[i]);
      } else {
        got_w.push_back(got[i]);
        exp_w.push_back(expect[i]);
      }
    }
    EXPECT_EQ(stray, 0u) << (which == 0 ? "k" : "v") << " cache: writes outside the tokens' slots";
    const float rtol =
        which == 0 ? RelTol(c.kv_dtype, 1e-5f) : (c.kv_dtype == DType::kF32 ? 0.0f : RelTol(c.kv_dtype, 0));
    EXPECT_TRUE(AllClose(got_w, exp_w, which == 0 ? 1e-5f : 0.0f, rtol)) << (which == 0 ? "k" : "v") << " cache";
  }
}

TEST(RopeStoreGpuTest, MatchesCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  std::mt19937 rng(13);
  for (int n : kRows) {
    for (int d : {8, 64, 128}) {
      for (int hkv : {1, 3, 8}) {
        for (int group : {1, 4, 8}) {
          if (n == 1000 && hkv * group > 8) continue;  // keep the CPU reference quick
          RunRopeCase({n, hkv, group, d, DType::kF32, DType::kF32}, rng);
          RunRopeCase({n, hkv, group, d, DType::kBF16, DType::kBF16}, rng);
        }
      }
    }
  }
  // Other dtype pairs, GQA 7, no pre-RoPE output.
  RunRopeCase({129, 2, 7, 64, DType::kF32, DType::kBF16, 0, 0, false}, rng);
  RunRopeCase({129, 2, 3, 128, DType::kBF16, DType::kF32}, rng);
  RunRopeCase({33, 2, 2, 64, DType::kF16, DType::kF16}, rng);
  // Unaligned qkv (scalar path) and unaligned cache slots (scalar stores).
  RunRopeCase({7, 2, 4, 64, DType::kF32, DType::kBF16, 4, 0}, rng);
  RunRopeCase({7, 2, 4, 128, DType::kBF16, DType::kBF16, 0, 2}, rng);
  RunRopeCase({7, 1, 2, 64, DType::kF32, DType::kF32, 0, 4}, rng);
  // Head dim not a multiple of 8 (scalar path).
  RunRopeCase({129, 2, 2, 6, DType::kF32, DType::kF32}, rng);
}

TEST(SwiGLUGpuTest, MatchesCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  std::mt19937 rng(14);
  for (DType od : kFloatTypes) {
    for (int n : kRows) {
      for (int F : {8, 64, 200, 4096, 14336, 13}) {
        if (n == 1000 && F == 14336) continue;
        SCOPED_TRACE(Name(od) + " n=" + std::to_string(n) + " F=" + std::to_string(F));
        const auto gu = RandomNonZero(static_cast<size_t>(n) * 2 * F, rng, -8.0f, 8.0f);
        DeviceBuffer d_gu(gu.size() * 4), d_out(static_cast<size_t>(n) * F * DTypeSize(od));
        d_gu.Upload(gu.data());
        LaunchSwiGLU(d_gu.as<float>(), n, F, d_out.get(), od, nullptr);
        EXPECT_LAUNCH_OK();
        std::vector<float> expect(static_cast<size_t>(n) * F);
        cpu::SwiGLU(gu.data(), n, F, expect.data());
        EXPECT_TRUE(AllClose(d_out.DownloadF32(od), expect, 1e-6f, RelTol(od, 1e-5f)));
      }
    }
  }
}

TEST(AddBiasGpuTest, MatchesCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  std::mt19937 rng(15);
  for (DType bd : kFloatTypes) {
    for (int n : kRows) {
      for (int dim : {8, 64, 200, 4096, 6}) {
        for (size_t off : {size_t{0}, size_t{4}}) {
          SCOPED_TRACE(Name(bd) + " n=" + std::to_string(n) + " dim=" + std::to_string(dim) +
                       " offset=" + std::to_string(off));
          auto x = RandomNonZero(static_cast<size_t>(n) * dim, rng);
          auto b = RandomNonZero(dim, rng);
          const auto b_bytes = ToDType(b, bd);
          DeviceBuffer d_x(x.size() * 4, off), d_b(b_bytes.size());
          d_x.Upload(x.data());
          d_b.Upload(b_bytes.data());
          LaunchAddBias(d_x.as<float>(), d_b.get(), bd, n, dim, nullptr);
          EXPECT_LAUNCH_OK();
          cpu::AddBias(x.data(), b.data(), n, dim);
          EXPECT_TRUE(AllClose(d_x.DownloadF32(DType::kF32), x, 0, 0));
        }
      }
    }
  }
}

TEST(ConvertGpuTest, MatchesHostConversion) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  std::mt19937 rng(16);
  for (DType sd : kFloatTypes) {
    for (DType dd : kFloatTypes) {
      for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{129}, int64_t{1000}, int64_t{4096 * 33 + 3}}) {
        for (size_t shift : {size_t{0}, size_t{1}}) {  // shift by one element: unaligned path
          SCOPED_TRACE(Name(sd) + "->" + Name(dd) + " n=" + std::to_string(n) + " shift=" + std::to_string(shift));
          auto v = RandomNonZero(n, rng, -100.0f, 100.0f);
          const auto src = ToDType(v, sd);  // v now holds the exact source values
          std::vector<float> expect = v;
          ToDType(expect, dd);  // host round-to-nearest-even to the destination type
          DeviceBuffer d_src(src.size(), shift * DTypeSize(sd)), d_dst(n * DTypeSize(dd), shift * DTypeSize(dd));
          d_src.Upload(src.data());
          LaunchConvert(d_src.get(), sd, d_dst.get(), dd, n, nullptr);
          EXPECT_LAUNCH_OK();
          EXPECT_TRUE(AllClose(d_dst.DownloadF32(dd), expect, 0, 0));
        }
      }
    }
  }
}

// Sampling: the GPU must pick exactly the CPU reference's token, except where
// the draw or the nucleus target sits within kSlack (relative to the kept mass)
// of a cumulative-mass boundary: expf differs by an ulp or two between the
// backends (p by <~4e-7 relative), so there the GPU's pick must be one the
// reference makes under such a nudge of uniform / top_p (or lie between those).
constexpr float kSlack = 1e-6f;

struct SampleStats {
  int rows = 0, near_boundary = 0;
};

void CheckSampleRows(const std::vector<float>& logits, int vocab, const std::vector<SamplingRow>& params,
                     SampleStats& stats) {
  const int rows = static_cast<int>(params.size());
  DeviceBuffer d_logits(logits.size() * 4), d_params(rows * sizeof(SamplingRow)), d_out(rows * sizeof(int32_t));
  d_logits.Upload(logits.data());
  d_params.Upload(params.data());
  LaunchSample(d_logits.as<float>(), rows, vocab, d_params.as<SamplingRow>(), d_out.as<int32_t>(), nullptr);
  EXPECT_LAUNCH_OK();
  std::vector<int32_t> got(rows);
  PENUMBRA_CUDA_OK(cudaMemcpy(got.data(), d_out.get(), rows * sizeof(int32_t), cudaMemcpyDeviceToHost));
  for (int r = 0; r < rows; ++r) {
    const float* row = logits.data() + static_cast<int64_t>(r) * vocab;
    const SamplingRow& p = params[r];
    cpu::SamplingRow cp{p.temperature, p.top_k, p.top_p, p.uniform};
    const int32_t expect = cpu::Sample(row, vocab, cp);
    std::set<int32_t> nudged;
    for (float du : {-kSlack, 0.0f, kSlack}) {
      for (float dp : {-kSlack, 0.0f, kSlack}) {
        if (dp != 0.0f && p.top_p >= 1.0f) continue;
        cpu::SamplingRow q = cp;
        q.uniform = std::min(std::max(p.uniform + du, 0.0f), 0.99999994f);
        if (dp != 0.0f) q.top_p = std::min(std::max(p.top_p + dp, 0.0f), 0.99999994f);
        nudged.insert(cpu::Sample(row, vocab, q));
      }
    }
    ++stats.rows;
    const std::string what = "row " + std::to_string(r) + " vocab " + std::to_string(vocab) + " T " +
                             std::to_string(p.temperature) + " k " + std::to_string(p.top_k) + " p " +
                             std::to_string(p.top_p) + " u " + std::to_string(p.uniform);
    if (nudged.size() == 1) {
      EXPECT_EQ(got[r], expect) << what;
    } else {
      ++stats.near_boundary;
      // The pick is monotone in uniform, so a pick between nudged picks is fine.
      EXPECT_TRUE(got[r] >= *nudged.begin() && got[r] <= *nudged.rbegin())
          << what << ": got " << got[r] << ", reference " << expect << " (nudged " << *nudged.begin() << ".."
          << *nudged.rbegin() << ")";
    }
  }
}

TEST(SampleGpuTest, MatchesCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> unif(0.0f, 1.0f);
  SampleStats stats;
  for (int vocab : {1, 7, 1000, 32003, 128256, 152064}) {
    for (int style = 0; style < 4; ++style) {
      const int rows = vocab >= 100000 ? 24 : 64;
      std::vector<float> logits(static_cast<size_t>(rows) * vocab);
      std::normal_distribution<float> g(0.0f, style == 1 ? 1.0f : 4.0f);
      for (auto& x : logits) {
        x = g(rng);
        if (style == 2) x = std::round(x * 2.0f) / 2.0f;                                  // many exact ties
        if (style == 3 && unif(rng) < 0.3f) x = -std::numeric_limits<float>::infinity();  // masked vocab
      }
      if (style == 3) {
        for (int r = 0; r < rows; ++r) logits[static_cast<size_t>(r) * vocab] = 1.0f;  // >= 1 finite logit
      }
      std::vector<SamplingRow> params(rows);
      for (int r = 0; r < rows; ++r) {
        SamplingRow& p = params[r];
        const int mode = r % 8;
        p.temperature = mode == 0 ? 0.0f : (mode == 1 ? -1.0f : 0.3f + 1.2f * unif(rng));
        p.top_k = (mode == 2 || mode == 5) ? 1 + static_cast<int>(unif(rng) * 100) : (mode == 6 ? vocab + 3 : 0);
        p.top_p = (mode == 3 || mode == 5) ? 0.05f + 0.9f * unif(rng) : (mode == 7 ? 1e-7f : 1.0f);
        p.uniform = std::min(unif(rng), 0.99999994f);
        if (r % 16 == 4) p.uniform = 0.0f;
      }
      CheckSampleRows(logits, vocab, params, stats);
    }
  }
  // (vocab 7 and 32003 give rows that are not 16-byte aligned: the scalar path.)
  std::cout << "sample parity: " << stats.rows << " rows, " << stats.near_boundary << " near a boundary\n";
  // Flat no-cut rows over a large vocab have tokens narrower than the slack;
  // still, most rows must be compared exactly.
  EXPECT_LE(stats.near_boundary * 4, stats.rows);
}

}  // namespace
}  // namespace penumbra::kernels
