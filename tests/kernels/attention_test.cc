// CPU attention (cpu::PrefillAttention, cpu::DecodeAttention) against a naive
// double-precision softmax attention, over head dims, GQA ratios, q_start and
// KV-cache strides.
#include <algorithm>
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
// Attention of one query row over n_keys rows; its log-sum-exp (natural log
// of the sum of exp(scale q.k)) into *lse when given.
void NaiveRow(const float* q, const float* k, const float* v, int64_t n_keys, int d, double scale, float* out,
              float* lse = nullptr) {
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
  if (lse != nullptr) *lse = static_cast<float>(m + std::log(l));
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
    SCOPED_TRACE(::testing::Message() << "q_start " << c.q_start << " nq " << c.nq << " hq " << c.hq << " hkv " << c.hkv
                                      << " d " << c.d);
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

// Slots a slot map marks empty are not attended: the result is attention over
// the buffer with those rows removed, whatever the rows hold (NaN here); a
// sequence whose every key is masked gets 0 and lse -inf.
TEST(AttentionCpuTest, DecodeMasksEmptySlots) {
  const int d = 16, group = 2, hkv = 2, hq = hkv * group, batch = 2, C = 4, slots = 5, row0 = 8;
  const std::vector<int32_t> lengths = {row0 + slots * C + 3, slots * C};
  const int capacity = 40;
  const int64_t head_stride = static_cast<int64_t>(capacity) * d;
  uint32_t seed = 5;
  auto q = RandomUniform(static_cast<size_t>(batch) * hq * d, seed++);
  std::vector<std::vector<float>> k, v;
  std::vector<const float*> kp, vp;
  for (int b = 0; b < batch; ++b) {
    k.push_back(RandomUniform(static_cast<size_t>(hkv) * head_stride, seed++));
    v.push_back(RandomUniform(static_cast<size_t>(hkv) * head_stride, seed++));
  }
  // Sequence 0: slots 1 and 3 of head 0, slot 4 of head 1 empty; sequence 1
  // (its slots from row 0): every slot empty.
  std::vector<std::vector<int32_t>> maps = {{7, -1, 9, -1, 11, 1, 2, 3, 4, -1}, std::vector<int32_t>(2 * slots, -1)};
  const std::vector<int> seq_row0 = {row0, 0};
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < hkv; ++h)
      for (int s = 0; s < slots; ++s)
        if (maps[b][h * slots + s] < 0)
          for (int i = 0; i < C * d; ++i) {
            const int64_t at = h * head_stride + (seq_row0[b] + s * C) * static_cast<int64_t>(d) + i;
            k[b][at] = NAN;
            v[b][at] = NAN;
          }
  for (int b = 0; b < batch; ++b) {
    kp.push_back(k[b].data());
    vp.push_back(v[b].data());
  }
  std::vector<const int32_t*> mp = {maps[0].data(), maps[1].data()};
  std::vector<float> out(q.size(), NAN), lse(static_cast<size_t>(batch) * hq, NAN);
  const float scale = 0.5f;
  for (int b = 0; b < batch; ++b) {
    DecodeAttentionArgs a;
    a.q = q.data() + static_cast<size_t>(b) * hq * d;
    a.k = kp.data() + b;
    a.v = vp.data() + b;
    a.lengths = lengths.data() + b;
    a.out = out.data() + static_cast<size_t>(b) * hq * d;
    a.lse = lse.data() + static_cast<size_t>(b) * hq;
    a.head_stride = head_stride;
    a.batch = 1;
    a.hq = hq;
    a.hkv = hkv;
    a.d = d;
    a.scale = scale;
    a.slot_maps = mp.data() + b;
    a.slot_row0 = seq_row0[b];
    a.slot_count = slots;
    a.slot_rows = C;
    DecodeAttention(a);
  }
  // Sequence 0 against naive attention over the live rows only.
  for (int h = 0; h < hq; ++h) {
    const int kvh = h / group;
    std::vector<float> lk, lv;
    for (int j = 0; j < lengths[0]; ++j) {
      const bool in_slots = j >= row0 && j < row0 + slots * C;
      if (in_slots && maps[0][kvh * slots + (j - row0) / C] < 0) continue;
      const int64_t at = kvh * head_stride + static_cast<int64_t>(j) * d;
      lk.insert(lk.end(), k[0].begin() + at, k[0].begin() + at + d);
      lv.insert(lv.end(), v[0].begin() + at, v[0].begin() + at + d);
    }
    std::vector<float> expect(d);
    const int live = static_cast<int>(lk.size()) / d;
    NaiveRow(q.data() + static_cast<size_t>(h) * d, lk.data(), lv.data(), live, d, scale, expect.data());
    const std::vector<float> got(out.begin() + h * d, out.begin() + (h + 1) * d);
    EXPECT_TRUE(AllClose(got, expect, 1e-5f, 1e-4f)) << "head " << h;
    double sum = 0;
    for (int j = 0; j < live; ++j) {
      double dot = 0;
      for (int e = 0; e < d; ++e) dot += double(q[h * d + e]) * lk[j * d + e];
      sum += std::exp(dot * scale);
    }
    EXPECT_NEAR(lse[h], std::log(sum), 1e-4) << "head " << h;
  }
  // Sequence 1: nothing live.
  for (int h = 0; h < hq; ++h) {
    EXPECT_EQ(lse[hq + h], -INFINITY) << "head " << h;
    for (int e = 0; e < d; ++e) EXPECT_EQ(out[(hq + h) * d + e], 0.0f) << "head " << h;
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

// Head kvh's keys (or values) of a sequence laid end to end: the first `base`
// rows from a shared prefix ([hkv][P][d]), then its own rows ([hkv][own_cap][d]).
std::vector<float> Concat(const std::vector<float>& prefix, int P, const std::vector<float>& own, int own_cap, int base,
                          int keys, int kvh, int d) {
  std::vector<float> out(static_cast<size_t>(keys) * d);
  for (int j = 0; j < keys; ++j)
    for (int e = 0; e < d; ++e)
      out[static_cast<size_t>(j) * d + e] = j < base ? prefix[(static_cast<size_t>(kvh) * P + j) * d + e]
                                                     : own[(static_cast<size_t>(kvh) * own_cap + (j - base)) * d + e];
  return out;
}

// Cascade: a sequence's keys split into a shared prefix (P keys, one copy for
// several sequences) and its own keys; the own part (decode with lse) merged
// with PrefixAttention equals attention over all keys, for decode (one query
// per sequence, rows a permuted subset of the batch) and for a prefill chunk.
TEST(AttentionCpuTest, CascadeDecodeEqualsAttentionOverAllKeys) {
  const int hq = 8, hkv = 2, d = 16, group = hq / hkv;
  const int P = 37, batch = 5;
  const int own_len[batch] = {1, 4, 9, 2, 6};
  const int32_t rows[] = {3, 0, 4, 1};  // sequence 2 has no prefix: its own part stays as is
  const int n = 4;
  const int own_cap = 12;
  const float scale = 0.3f;
  uint32_t seed = 11;
  auto q = RandomUniform(static_cast<size_t>(batch) * hq * d, seed++);
  auto pk = RandomUniform(static_cast<size_t>(hkv) * P * d, seed++);
  auto pv = RandomUniform(static_cast<size_t>(hkv) * P * d, seed++);
  std::vector<std::vector<float>> ok(batch), ov(batch);
  std::vector<const float*> kp(batch), vp(batch);
  for (int b = 0; b < batch; ++b) {
    ok[b] = RandomUniform(static_cast<size_t>(hkv) * own_cap * d, seed++);
    ov[b] = RandomUniform(static_cast<size_t>(hkv) * own_cap * d, seed++);
    kp[b] = ok[b].data();
    vp[b] = ov[b].data();
  }
  std::vector<int32_t> lengths(own_len, own_len + batch);
  std::vector<float> out(q.size(), NAN), lse(static_cast<size_t>(batch) * hq, NAN);
  DecodeAttentionArgs da;
  da.q = q.data();
  da.k = kp.data();
  da.v = vp.data();
  da.lengths = lengths.data();
  da.out = out.data();
  da.lse = lse.data();
  da.head_stride = static_cast<int64_t>(own_cap) * d;
  da.batch = batch;
  da.hq = hq;
  da.hkv = hkv;
  da.d = d;
  da.scale = scale;
  DecodeAttention(da);
  PrefixAttentionArgs pa;
  pa.q = q.data();
  pa.rows = rows;
  pa.n = n;
  pa.k = pk.data();
  pa.v = pv.data();
  pa.head_stride = static_cast<int64_t>(P) * d;
  pa.keys = P;
  pa.out = out.data();
  pa.own_lse = lse.data();
  pa.lse_out = lse.data();  // aliasing own_lse: the merged log-sum-exp replaces the own part's
  pa.hq = hq;
  pa.hkv = hkv;
  pa.d = d;
  pa.scale = scale;
  const std::vector<float> own_lse = lse;
  PrefixAttention(pa);
  std::vector<float> expect(q.size()), expect_lse = own_lse;
  for (int b = 0; b < batch; ++b) {
    const bool attached = std::find(rows, rows + n, b) != rows + n;
    const int base = attached ? P : 0;
    const int keys = base + own_len[b];
    for (int h = 0; h < hq; ++h) {
      const std::vector<float> k = Concat(pk, P, ok[b], own_cap, base, keys, h / group, d);
      const std::vector<float> v = Concat(pv, P, ov[b], own_cap, base, keys, h / group, d);
      const int64_t off = (static_cast<int64_t>(b) * hq + h) * d;
      NaiveRow(q.data() + off, k.data(), v.data(), keys, d, scale, expect.data() + off,
               attached ? &expect_lse[static_cast<size_t>(b) * hq + h] : nullptr);
    }
  }
  EXPECT_TRUE(AllClose(out, expect, 1e-5f, 1e-4f));
  EXPECT_TRUE(AllClose(lse, expect_lse, 1e-5f, 1e-5f)) << "merged log-sum-exp (rows not attached keep theirs)";
  // Without an own part, PrefixAttention alone is attention over the prefix,
  // and lse_out its log-sum-exp.
  std::vector<float> only(q.size(), 0.0f), only_expect(q.size(), 0.0f);
  std::vector<float> only_lse(lse.size(), 0.0f), only_expect_lse(lse.size(), 0.0f);
  pa.out = only.data();
  pa.own_lse = nullptr;
  pa.lse_out = only_lse.data();
  PrefixAttention(pa);
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < hq; ++h) {
      const int64_t off = (static_cast<int64_t>(rows[i]) * hq + h) * d;
      const size_t kv = static_cast<size_t>(h / group) * P * d;
      NaiveRow(q.data() + off, pk.data() + kv, pv.data() + kv, P, d, scale, only_expect.data() + off,
               &only_expect_lse[static_cast<size_t>(rows[i]) * hq + h]);
    }
  EXPECT_TRUE(AllClose(only, only_expect, 1e-5f, 1e-4f));
  EXPECT_TRUE(AllClose(only_lse, only_expect_lse, 1e-5f, 1e-5f));
}

// Context parallel's merge: the keys split into 3 disjoint parts (one empty
// for some rows: lse -inf), each part's decode attention with its
// log-sum-exp, laid out as one message per part (outputs, then
// log-sum-exps); MergeAttention gives attention over all the keys and their
// log-sum-exp.
TEST(AttentionCpuTest, MergeOfDisjointKeyPartsEqualsAttentionOverAllKeys) {
  const int hq = 4, hkv = 2, d = 16, group = hq / hkv, batch = 3, parts = 3;
  const int len[parts][batch] = {{5, 1, 7}, {3, 0, 2}, {9, 4, 1}};  // part 1 holds no key of sequence 1
  const int cap = 9;
  const float scale = 0.25f;
  uint32_t seed = 31;
  auto q = RandomUniform(static_cast<size_t>(batch) * hq * d, seed++);
  std::vector<std::vector<float>> k(parts * batch), v(parts * batch);
  const int rows = batch * hq;
  const int64_t stride = static_cast<int64_t>(rows) * d + rows;  // a part: outputs, then log-sum-exps
  std::vector<float> msg(static_cast<size_t>(parts) * stride, NAN);
  for (int p = 0; p < parts; ++p) {
    std::vector<const float*> kp(batch), vp(batch);
    std::vector<int32_t> lengths(batch);
    for (int b = 0; b < batch; ++b) {
      k[p * batch + b] = RandomUniform(static_cast<size_t>(hkv) * cap * d, seed++);
      v[p * batch + b] = RandomUniform(static_cast<size_t>(hkv) * cap * d, seed++);
      kp[b] = k[p * batch + b].data();
      vp[b] = v[p * batch + b].data();
      lengths[b] = len[p][b];
    }
    DecodeAttentionArgs da;
    da.q = q.data();
    da.k = kp.data();
    da.v = vp.data();
    da.lengths = lengths.data();
    da.out = msg.data() + p * stride;
    da.lse = msg.data() + p * stride + static_cast<int64_t>(rows) * d;
    da.head_stride = static_cast<int64_t>(cap) * d;
    da.batch = batch;
    da.hq = hq;
    da.hkv = hkv;
    da.d = d;
    da.scale = scale;
    DecodeAttention(da);
    for (int b = 0; b < batch; ++b) {  // a part with no key: weight 0, whatever its output
      if (len[p][b] > 0) continue;
      for (int h = 0; h < hq; ++h) {
        msg[p * stride + static_cast<int64_t>(rows) * d + b * hq + h] = -INFINITY;
        std::fill_n(msg.data() + p * stride + (static_cast<int64_t>(b) * hq + h) * d, d, 1e30f);
      }
    }
  }
  std::vector<float> out(q.size(), NAN), lse(rows, NAN);
  MergeAttention(msg.data(), stride, msg.data() + static_cast<int64_t>(rows) * d, stride, parts, rows, d, out.data(),
                 lse.data());
  std::vector<float> expect(q.size()), expect_lse(rows);
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < hq; ++h) {
      std::vector<float> kk, vv;
      for (int p = 0; p < parts; ++p) {
        const size_t off = static_cast<size_t>(h / group) * cap * d;
        kk.insert(kk.end(), k[p * batch + b].begin() + off, k[p * batch + b].begin() + off + len[p][b] * d);
        vv.insert(vv.end(), v[p * batch + b].begin() + off, v[p * batch + b].begin() + off + len[p][b] * d);
      }
      const int keys = static_cast<int>(kk.size()) / d;
      const int64_t o = (static_cast<int64_t>(b) * hq + h) * d;
      NaiveRow(q.data() + o, kk.data(), vv.data(), keys, d, scale, expect.data() + o);
      double m = -INFINITY, sum = 0;
      std::vector<double> sc(keys);
      for (int j = 0; j < keys; ++j) {
        double x = 0;
        for (int e = 0; e < d; ++e) x += static_cast<double>(q[o + e]) * kk[j * d + e];
        m = std::max(m, sc[j] = x * scale);
      }
      for (double x : sc) sum += std::exp(x - m);
      expect_lse[b * hq + h] = static_cast<float>(m + std::log(sum));
    }
  }
  EXPECT_TRUE(AllClose(out, expect, 1e-5f, 1e-4f));
  EXPECT_TRUE(AllClose(lse, expect_lse, 1e-5f, 1e-4f));
}

TEST(AttentionCpuTest, CascadePrefillEqualsAttentionOverAllKeys) {
  const int hq = 4, hkv = 4, d = 8, P = 50, start = 3, nq = 6, own_cap = 16;  // own rows 0..start+nq-1
  const float scale = 0.5f;
  auto q = RandomUniform(static_cast<size_t>(nq) * hq * d, 21);
  auto pk = RandomUniform(static_cast<size_t>(hkv) * P * d, 22);
  auto pv = RandomUniform(static_cast<size_t>(hkv) * P * d, 23);
  auto okk = RandomUniform(static_cast<size_t>(hkv) * own_cap * d, 24);
  auto ovv = RandomUniform(static_cast<size_t>(hkv) * own_cap * d, 25);
  std::vector<float> out(q.size(), NAN), lse(static_cast<size_t>(nq) * hq, NAN);
  PrefillAttentionArgs a;
  a.q = q.data();
  a.k = okk.data();
  a.v = ovv.data();
  a.out = out.data();
  a.lse = lse.data();
  a.head_stride = static_cast<int64_t>(own_cap) * d;
  a.q_start = start;
  a.nq = nq;
  a.hq = hq;
  a.hkv = hkv;
  a.d = d;
  a.scale = scale;
  PrefillAttention(a);
  std::vector<int32_t> rows(nq);
  for (int i = 0; i < nq; ++i) rows[i] = i;
  PrefixAttentionArgs pa;
  pa.q = q.data();
  pa.rows = rows.data();
  pa.n = nq;
  pa.k = pk.data();
  pa.v = pv.data();
  pa.head_stride = static_cast<int64_t>(P) * d;
  pa.keys = P;
  pa.out = out.data();
  pa.own_lse = lse.data();
  pa.lse_out = lse.data();  // aliasing own_lse: the merged log-sum-exp replaces the own part's
  pa.hq = hq;
  pa.hkv = hkv;
  pa.d = d;
  pa.scale = scale;
  PrefixAttention(pa);
  std::vector<float> expect(q.size()), expect_lse(lse.size());
  for (int i = 0; i < nq; ++i)
    for (int h = 0; h < hq; ++h) {
      const int keys = P + start + i + 1;
      const std::vector<float> k = Concat(pk, P, okk, own_cap, P, keys, h, d);
      const std::vector<float> v = Concat(pv, P, ovv, own_cap, P, keys, h, d);
      const int64_t off = (static_cast<int64_t>(i) * hq + h) * d;
      NaiveRow(q.data() + off, k.data(), v.data(), keys, d, scale, expect.data() + off,
               &expect_lse[static_cast<size_t>(i) * hq + h]);
    }
  EXPECT_TRUE(AllClose(out, expect, 1e-5f, 1e-4f));
  EXPECT_TRUE(AllClose(lse, expect_lse, 1e-5f, 1e-5f)) << "the merged log-sum-exp";
}

}  // namespace
}  // namespace penumbra::kernels::cpu
