// CPU attention (prefill and decode): f32, exact softmax per (query, head) row,
// numerically stable (max subtracted before exp). ParallelFor tasks are
// (query block, KV head) for prefill and (sequence, KV head) for decode; each
// task computes all scores of its rows (scale * q.k_j), the softmax, then
// out = sum_j p_j v_j / sum_j p_j, with contiguous inner loops over d.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cpu/ops.h"

namespace penumbra::kernels::cpu {
namespace {

// q.k with 8 independent partial sums, so the compiler can vectorize it
// without reassociating a single sum.
float Dot(const float* __restrict a, const float* __restrict b, int d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int e = 0;
  for (; e + 8 <= d; e += 8)
    for (int u = 0; u < 8; ++u) acc[u] += a[e + u] * b[e + u];
  for (; e < d; ++e) acc[0] += a[e] * b[e];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// o += p * x over d elements (o and x never alias); blocks of 8 so that the
// -O2 cost model vectorizes it (no runtime trip-count epilogue).
void Axpy(float p, const float* __restrict x, float* __restrict o, int d) {
  int e = 0;
  for (; e + 8 <= d; e += 8)
    for (int u = 0; u < 8; ++u) o[e + u] += p * x[e + u];
  for (; e < d; ++e) o[e] += p * x[e];
}

// Attention for `n_rows` query rows that share one KV head (rows of d
// contiguous floats at k / v): row r attends keys 0 .. n_keys[r]-1. Keys are
// the outer loop so each K / V row is read once for all the rows (the group's
// query heads, and for prefill several queries) while it sits in L1.
// With lse, lse[r] = ln sum_j exp(scale q_r.k_j) (cascade merges).
void AttendRows(int n_rows, const float* const* q, const int64_t* n_keys, const float* k, const float* v, int d,
                float scale, std::vector<float>& scores, float* const* out, float* const* lse = nullptr) {
  const int64_t max_keys = *std::max_element(n_keys, n_keys + n_rows);
  scores.resize(static_cast<size_t>(n_rows) * max_keys);
  for (int64_t j = 0; j < max_keys; ++j) {
    const float* kj = k + j * d;
    for (int r = 0; r < n_rows; ++r)
      if (j < n_keys[r]) scores[r * max_keys + j] = Dot(q[r], kj, d) * scale;
  }
  std::vector<float> inv_l(n_rows);
  for (int r = 0; r < n_rows; ++r) {
    float* s = scores.data() + r * max_keys;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n_keys[r]; ++j) m = std::max(m, s[j]);
    float l = 0.0f;
    for (int64_t j = 0; j < n_keys[r]; ++j) {
      s[j] = std::exp(s[j] - m);
      l += s[j];
    }
    inv_l[r] = n_keys[r] > 0 ? 1.0f / l : 0.0f;
    if (lse != nullptr) *lse[r] = m + std::log(l);
    std::fill(out[r], out[r] + d, 0.0f);
  }
  for (int64_t j = 0; j < max_keys; ++j) {
    const float* vj = v + j * d;
    for (int r = 0; r < n_rows; ++r) {
      if (j >= n_keys[r]) continue;
      Axpy(scores[r * max_keys + j], vj, out[r], d);
    }
  }
  for (int r = 0; r < n_rows; ++r)
    for (int e = 0; e < d; ++e) out[r][e] *= inv_l[r];
}

// Queries per prefill task (times the group's heads = rows sharing K/V reads).
constexpr int kQueriesPerTask = 8;

}  // namespace

void PrefillAttention(const PrefillAttentionArgs& a) {
  if (a.nq <= 0 || a.hq <= 0) return;
  const int group = a.hq / a.hkv;
  const int q_blocks = (a.nq + kQueriesPerTask - 1) / kQueriesPerTask;
  // Task = (query block, kv head); later query blocks (more keys) first.
  ParallelFor(static_cast<int64_t>(q_blocks) * a.hkv, [&](int64_t task) {
    thread_local std::vector<float> scores;
    const int qb = q_blocks - 1 - static_cast<int>(task / a.hkv), kvh = static_cast<int>(task % a.hkv);
    const int i0 = qb * kQueriesPerTask, i1 = std::min(a.nq, i0 + kQueriesPerTask);
    std::vector<const float*> q;
    std::vector<float*> out, lse;
    std::vector<int64_t> n_keys;
    for (int i = i0; i < i1; ++i)
      for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        const int64_t off = (static_cast<int64_t>(i) * a.hq + h) * a.d;  // [nq, hq, d]
        q.push_back(a.q + off);
        out.push_back(a.out + off);
        if (a.lse != nullptr) lse.push_back(a.lse + static_cast<int64_t>(i) * a.hq + h);
        n_keys.push_back(static_cast<int64_t>(a.q_start) + i + 1);
      }
    AttendRows(static_cast<int>(q.size()), q.data(), n_keys.data(), a.k + kvh * a.head_stride,
               a.v + kvh * a.head_stride, a.d, a.scale, scores, out.data(), a.lse != nullptr ? lse.data() : nullptr);
  });
}

void DecodeAttention(const DecodeAttentionArgs& a) {
  if (a.batch <= 0 || a.hq <= 0) return;
  const int group = a.hq / a.hkv;
  // Task = (sequence, kv head): the group's query heads share each K/V read.
  ParallelFor(static_cast<int64_t>(a.batch) * a.hkv, [&](int64_t task) {
    thread_local std::vector<float> scores, live_k, live_v;
    const int b = static_cast<int>(task / a.hkv), kvh = static_cast<int>(task % a.hkv);
    std::vector<const float*> q;
    std::vector<float*> out, lse;
    const float* k = a.k[b] + kvh * a.head_stride;
    const float* v = a.v[b] + kvh * a.head_stride;
    int64_t len = a.lengths[b];
    if (a.slot_maps != nullptr) {
      // The rows of empty slots left out: the live rows, copied in order
      // (V in place from slot_values where the slot holds a document chunk).
      const int32_t* map = a.slot_maps[b] + static_cast<int64_t>(kvh) * a.slot_count;
      const int64_t s0 = a.slot_row0, s1 = s0 + static_cast<int64_t>(a.slot_count) * a.slot_rows;
      live_k.clear();
      live_v.clear();
      for (int64_t j = 0; j < len; ++j) {
        const bool in_slots = j >= s0 && j < s1;
        const int32_t chunk = in_slots ? map[(j - s0) / a.slot_rows] : -1;
        if (in_slots && chunk < 0) continue;
        const float* vrow = v + j * a.d;
        if (a.slot_values != nullptr && in_slots && chunk < a.slot_values_chunks)
          vrow = a.slot_values[b] + ((kvh * a.slot_values_stride + chunk) * a.slot_rows + (j - s0) % a.slot_rows) * a.d;
        live_k.insert(live_k.end(), k + j * a.d, k + (j + 1) * a.d);
        live_v.insert(live_v.end(), vrow, vrow + a.d);
      }
      len = static_cast<int64_t>(live_k.size()) / a.d;
      k = live_k.data();
      v = live_v.data();
    }
    std::vector<int64_t> n_keys(group, len);
    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
      const int64_t off = (static_cast<int64_t>(b) * a.hq + h) * a.d;  // [batch, hq, d]
      q.push_back(a.q + off);
      out.push_back(a.out + off);
      if (a.lse != nullptr) lse.push_back(a.lse + static_cast<int64_t>(b) * a.hq + h);
    }
    AttendRows(group, q.data(), n_keys.data(), k, v, a.d, a.scale, scores, out.data(),
               a.lse != nullptr ? lse.data() : nullptr);
  });
}

void PrefixAttention(const PrefixAttentionArgs& a) {
  if (a.n <= 0 || a.hq <= 0 || a.keys <= 0) return;
  const int group = a.hq / a.hkv;
  // Task = (block of sequences, kv head): every row of the block and of the
  // group's heads reads each prefix K/V row once.
  const int blocks = (a.n + kQueriesPerTask - 1) / kQueriesPerTask;
  ParallelFor(static_cast<int64_t>(blocks) * a.hkv, [&](int64_t task) {
    thread_local std::vector<float> scores, part, part_lse;
    const int blk = static_cast<int>(task / a.hkv), kvh = static_cast<int>(task % a.hkv);
    const int i0 = blk * kQueriesPerTask, i1 = std::min(a.n, i0 + kQueriesPerTask);
    const int n_rows = (i1 - i0) * group;
    part.resize(static_cast<size_t>(n_rows) * a.d);
    part_lse.resize(n_rows);
    std::vector<const float*> q;
    std::vector<float*> out, lse;
    for (int i = i0; i < i1; ++i)
      for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        const int r = static_cast<int>(q.size());
        q.push_back(a.q + (static_cast<int64_t>(a.rows[i]) * a.hq + h) * a.d);
        out.push_back(part.data() + static_cast<size_t>(r) * a.d);
        lse.push_back(part_lse.data() + r);
      }
    const std::vector<int64_t> n_keys(n_rows, a.keys);
    AttendRows(n_rows, q.data(), n_keys.data(), a.k + kvh * a.head_stride, a.v + kvh * a.head_stride, a.d, a.scale,
               scores, out.data(), lse.data());
    int r = 0;
    for (int i = i0; i < i1; ++i)
      for (int h = kvh * group; h < (kvh + 1) * group; ++h, ++r) {
        const int64_t row = static_cast<int64_t>(a.rows[i]) * a.hq + h;
        float* dst = a.out + row * a.d;
        const float* src = part.data() + static_cast<size_t>(r) * a.d;
        if (a.own_lse == nullptr) {
          std::copy(src, src + a.d, dst);
          if (a.lse_out != nullptr) a.lse_out[row] = part_lse[r];
          continue;
        }
        const float mx = std::max(part_lse[r], a.own_lse[row]);
        const float wp = std::exp(part_lse[r] - mx), wo = std::exp(a.own_lse[row] - mx);
        const float inv = 1.0f / (wp + wo);
        for (int e = 0; e < a.d; ++e) dst[e] = (wp * src[e] + wo * dst[e]) * inv;
        if (a.lse_out != nullptr) a.lse_out[row] = mx + std::log(wp + wo);
      }
  });
}

void MergeAttention(const float* x, int64_t x_part_stride, const float* lse, int64_t lse_part_stride, int parts,
                    int rows, int d, float* out, float* lse_out) {
  std::vector<float> acc(static_cast<size_t>(d));
  for (int r = 0; r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int p = 0; p < parts; ++p) m = std::max(m, lse[p * lse_part_stride + r]);
    const bool none = std::isinf(m) && m < 0;
    float total = 0.0f;
    for (int p = 0; p < parts; ++p) total += none ? 0.0f : std::exp(lse[p * lse_part_stride + r] - m);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int p = 0; p < parts; ++p) {
      const float w = none ? 0.0f : std::exp(lse[p * lse_part_stride + r] - m) / total;
      const float* xp = x + p * x_part_stride + static_cast<int64_t>(r) * d;
      for (int j = 0; j < d; ++j) acc[j] += w * xp[j];
    }
    std::copy(acc.begin(), acc.end(), out + static_cast<int64_t>(r) * d);
    if (lse_out != nullptr) lse_out[r] = none ? m : m + std::log(total);
  }
}

}  // namespace penumbra::kernels::cpu
