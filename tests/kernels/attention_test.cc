// CPU attention (cpu::PrefillAttention, cpu::DecodeAttention) against a naive
// double-precision softmax attention, over head dims, GQA ratios, q_start and
// KV-cache strides.
#include <cmath>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cpu/ops.h"
#include "tests/test_util.h"

namespace penumbra::kernels::cpu {
namespace {

using ::penumbra::testing::AllClose;

using ::penumbra::testing::RandomUniform;

// out [d] = softmax(scale * q.K^T) V over keys 0..n_keys-1, in double.
void NaiveRow(const float* q, const float* k, const float* v, int64_t n_keys, int d, double scale, float* out) {
  std::vector<double> s(n_keys);
  double m = -INFINITY;
  for (int64_t j = 0; j < n_keys; ++j) {
    double x = 0;
    for (int e = 0; e < d; ++e) x += static_cast<double>(q[e]) * k[j * d + e];
    s[j] = x * scale;
    m = std::max(m, s[j]);
  }
  double l = 0;
  for (auto& x : s) l += (x = std::exp(x - m));
  for (int e = 0; e < d; ++e) {
    double o = 0;
    for (int64_t j = 0; j < n_keys; ++j) o += s[j] * v[j * d + e];
    out[e] = static_cast<float>(o / l);
  }
}

struct PrefillCase {
  int q_start, nq, hq, hkv, d;
};

TEST(AttentionCpuTest, PrefillMatchesNaive) {
  const PrefillCase cases[] = {
      {0, 1, 1, 1, 8},     {0, 7, 4, 4, 8},     {5, 1, 2, 1, 8},   {0, 17, 8, 4, 64},  {13, 9, 8, 2, 64},
      {100, 3, 8, 1, 128}, {0, 33, 32, 8, 128}, {40, 20, 4, 4, 8}, {3, 64, 16, 2, 64},
  };
  uint32_t seed = 1;
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "q_start " << c.q_start << " nq " << c.nq << " hq " << c.hq << " hkv "
                                      << c.hkv << " d " << c.d);
    const int keys = c.q_start + c.nq;
    const int capacity = keys + 5;  // head_stride larger than the keys in use
    const int64_t head_stride = static_cast<int64_t>(capacity) * c.d;
    auto q = RandomUniform(static_cast<size_t>(c.nq) * c.hq * c.d, seed++);
    auto k = RandomUniform(static_cast<size_t>(c.hkv) * head_stride, seed++);
    auto v = RandomUniform(static_cast<size_t>(c.hkv) * head_stride, seed++);
    std::vector<float> out(q.size(), NAN), expect(q.size());
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    PrefillAttentionArgs a;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.out = out.data();
    a.head_stride = head_stride;
    a.q_start = c.q_start;
    a.nq = c.nq;
    a.hq = c.hq;
    a.hkv = c.hkv;
    a.d = c.d;
    a.scale = scale;
    PrefillAttention(a);
    const int group = c.hq / c.hkv;
    for (int i = 0; i < c.nq; ++i)
      for (int h = 0; h < c.hq; ++h) {
        const int64_t off = (static_cast<int64_t>(i) * c.hq + h) * c.d;
        const int64_t kv = (h / group) * head_stride;
        NaiveRow(q.data() + off, k.data() + kv, v.data() + kv, c.q_start + i + 1, c.d, scale, expect.data() + off);
      }
    EXPECT_TRUE(AllClose(out, expect, 1e-5f, 1e-4f));
  }
}

TEST(AttentionCpuTest, DecodeMatchesNaive) {
  for (int d : {8, 64, 128}) {
    for (int group : {1, 2, 4, 8}) {
      const int hkv = group == 8 ? 1 : 2, hq = hkv * group, batch = 3;
      SCOPED_TRACE(::testing::Message() << "d " << d << " group " << group);
      const std::vector<int32_t> lengths = {1, 37, 300};
      const int capacity = 310;
      const int64_t head_stride = static_cast<int64_t>(capacity) * d;
      uint32_t seed = 100 + d + group;
      auto q = RandomUniform(static_cast<size_t>(batch) * hq * d, seed++);
      std::vector<std::vector<float>> k, v;
      std::vector<const float*> kp, vp;
      for (int b = 0; b < batch; ++b) {
        k.push_back(RandomUniform(static_cast<size_t>(hkv) * head_stride, seed++));
        v.push_back(RandomUniform(static_cast<size_t>(hkv) * head_stride, seed++));
        kp.push_back(k.back().data());
        vp.push_back(v.back().data());
      }
      std::vector<float> out(q.size(), NAN), expect(q.size());
      const float scale = 0.7f / std::sqrt(static_cast<float>(d));
      DecodeAttentionArgs a;
      a.q = q.data();
      a.k = kp.data();
      a.v = vp.data();
      a.lengths = lengths.data();
      a.out = out.data();
      a.head_stride = head_stride;
      a.batch = batch;
      a.hq = hq;
      a.hkv = hkv;
      a.d = d;
      a.scale = scale;
      DecodeAttention(a);
      for (int b = 0; b < batch; ++b)
        for (int h = 0; h < hq; ++h) {
          const int64_t off = (static_cast<int64_t>(b) * hq + h) * d;
          const int64_t kv = (h / group) * head_stride;
          NaiveRow(q.data() + off, kp[b] + kv, vp[b] + kv, lengths[b], d, scale, expect.data() + off);
        }
      EXPECT_TRUE(AllClose(out, expect, 1e-5f, 1e-4f));
    }
  }
}

// Large scores (sharp softmax) must not overflow: max subtraction.
TEST(AttentionCpuTest, LargeScoresStayFinite) {
  const int d = 8, keys = 50;
  auto q = RandomUniform(d, 7), k = RandomUniform(static_cast<size_t>(keys) * d, 8),
       v = RandomUniform(static_cast<size_t>(keys) * d, 9);
  for (auto& x : q) x *= 100.0f;
  std::vector<float> out(d), expect(d);
  PrefillAttentionArgs a;
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.out = out.data();
  a.head_stride = static_cast<int64_t>(keys) * d;
  a.q_start = keys - 1;
  a.nq = 1;
  a.hq = 1;
  a.hkv = 1;
  a.d = d;
  a.scale = 10.0f;
  PrefillAttention(a);
  NaiveRow(q.data(), k.data(), v.data(), keys, d, 10.0, expect.data());
  EXPECT_TRUE(AllClose(out, expect, 1e-5f, 1e-4f));
}

}  // namespace
}  // namespace penumbra::kernels::cpu
