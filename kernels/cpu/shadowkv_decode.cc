#include "kernels/cpu/shadowkv_decode.h"
#include "kernels/value_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <glog/logging.h>

#include "kernels/cpu/ops.h"
#include "kernels/landmark_format.h"

namespace penumbra::kernels::cpu {

namespace {
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNegInf = -kInf;
}  // namespace

uint32_t TopKKey(float v, bool smallest, bool skip_worst_inf) {
  if (std::isnan(v)) return 0;
  if (skip_worst_inf && v == (smallest ? kInf : -kInf)) return 0;
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return smallest ? ~key : key;
}

void TopK(const TopKArgs& a) {
  ParallelFor(a.rows, [&](int64_t row) {
    const int n = a.counts ? a.counts[row / a.rows_per_count] : a.uniform_count;
    const float* v = a.values + row * a.stride;
    int32_t* out = a.out + row * a.out_stride;
    std::vector<uint32_t> key(std::max(n, 0));
    std::vector<int32_t> idx;
    for (int i = 0; i < n; ++i) {
      key[i] = TopKKey(v[i], a.smallest, a.skip_worst_inf);
      if (!(a.skip_worst_inf && key[i] == 0)) idx.push_back(i);
    }
    const int cand = static_cast<int>(idx.size());
    const int take = std::min(a.k, cand);
    if (take < cand) {
      auto before = [&](int32_t x, int32_t y) { return key[x] != key[y] ? key[x] > key[y] : x < y; };
      std::nth_element(idx.begin(), idx.begin() + take, idx.end(), before);
      idx.resize(take);
      std::sort(idx.begin(), idx.end());
    }
    for (int i = 0; i < a.k; ++i) out[i] = i < take ? idx[i] : -1;
  });
}

void ShadowkvScore(const ShadowkvScoreArgs& a) {
  const int group = a.hq / a.hkv;
  ParallelFor(static_cast<int64_t>(a.batch) * a.hkv, [&](int64_t row) {
    const int b = static_cast<int>(row / a.hkv), h = static_cast<int>(row % a.hkv);
    const int n = a.n_chunks[b];
    // Landmark rows: S per chunk (chunk c's at rows c * S ..), scored as rows;
    // a chunk's score is its best row's.
    const int S = std::max(1, a.landmarks_per_chunk);
    const int rows = n * S;
    const int64_t cap = a.landmark_cap > 0 ? a.landmark_cap : a.chunk_cap;
    const bool fp8 = a.landmarks_fp8 != nullptr;
    const int64_t rec = LandmarkChunkElems(S, a.d, fp8);  // elements per chunk record
    // Row v's values (fp8: decoded, times its record's scale) into `buf`.
    std::vector<float> buf(a.d);
    const float* lut = fp8 ? E4M3Table() : nullptr;
    const auto landmark_row = [&](int v) -> const float* {
      const int64_t chunk = v / S, j = v % S;
      // Below shared_chunks in the attached prefix's records, else in the sequence's own.
      const bool pre = chunk < a.shared_chunks;
      const int64_t at = (pre ? h * a.shared_chunks + chunk : h * cap + chunk - a.shared_chunks) * rec;
      if (!fp8) return (pre ? a.shared_landmarks[b] : a.landmarks[b]) + at + j * a.d;
      const uint8_t* base = (pre ? a.shared_landmarks_fp8[b] : a.landmarks_fp8[b]) + at;
      float scale;
      std::memcpy(&scale, base + static_cast<int64_t>(S) * a.d, sizeof(float));
      for (int i = 0; i < a.d; ++i) buf[i] = lut[base[j * a.d + i]] * scale;
      return buf.data();
    };
    const uint8_t* excl = a.excluded ? a.excluded[b] + static_cast<int64_t>(h) * a.chunk_cap : nullptr;
    float* out = a.scores + row * a.score_stride;
    if (a.stats_out == nullptr)
      for (int c = 0; c < a.max_chunks; ++c) out[c] = kNegInf;
    // Every query head's logits, each landmark row read (and decoded) once.
    std::vector<float> logits(static_cast<size_t>(group) * std::max(rows, 0));
    const float* q0 = a.q + (static_cast<int64_t>(b) * a.hq + h * group) * a.d;
    for (int v = 0; v < rows; ++v) {
      const bool excluded = excl && excl[v / S];
      const float* l = excluded ? nullptr : landmark_row(v);
      for (int g = 0; g < group; ++g) {
        float dot = 0.0f;
        if (!excluded) {
          const float* q = q0 + static_cast<int64_t>(g) * a.d;
          for (int j = 0; j < a.d; ++j) dot += q[j] * l[j];
        }
        logits[static_cast<size_t>(g) * rows + v] = excluded ? kNegInf : dot * a.scale;
      }
    }
    for (int g = 0; g < group; ++g) {
      const float* logit = logits.data() + static_cast<size_t>(g) * rows;
      float mx = kNegInf;
      for (int v = 0; v < rows; ++v) mx = std::max(mx, logit[v]);
      double sum = 0.0;
      if (mx != kNegInf)
        for (int v = 0; v < rows; ++v)
          if (logit[v] != kNegInf) sum += std::exp(logit[v] - mx);
      const int64_t head = static_cast<int64_t>(b) * a.hq + h * group + g;
      if (a.stats_out != nullptr) {  // the first of two calls: statistics only
        a.stats_out[head * 2] = mx;
        a.stats_out[head * 2 + 1] = static_cast<float>(sum);
        continue;
      }
      if (a.stats_in != nullptr) {  // normalized over every part (shard)
        float m = kNegInf;
        for (int p = 0; p < a.stats_parts; ++p) m = std::max(m, a.stats_in[p * a.stats_part_stride + head * 2]);
        double s = 0.0;
        if (m != kNegInf) {
          for (int p = 0; p < a.stats_parts; ++p) {
            const float* st = a.stats_in + p * a.stats_part_stride + head * 2;
            if (st[0] != kNegInf) s += static_cast<double>(st[1]) * std::exp(static_cast<double>(st[0]) - m);
          }
        }
        mx = m;
        sum = s;
      }
      if (mx == kNegInf) continue;  // nothing selectable
      const float fsum = static_cast<float>(sum);
      for (int v = 0; v < rows; ++v)
        if (logit[v] != kNegInf) out[v / S] = std::max(out[v / S], std::exp(logit[v] - mx) / fsum);
    }
    if (a.successors > 0 && a.stats_out == nullptr) {
      // Each selectable chunk as high as its best of `successors` predecessors.
      const std::vector<float> own(out, out + std::max(n, 0));
      for (int c = 0; c < n; ++c) {
        if (own[c] == kNegInf) continue;
        for (int j = 1; j <= a.successors && c - j >= 0; ++j) out[c] = std::max(out[c], own[c - j]);
      }
    }
  });
}

void SelectionScores(const float* scores, int64_t score_stride, const int32_t* selection, int64_t stride, int rows,
                     int k, float* out) {
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t i = 0; i < stride; ++i) {
      const int32_t c = i < k ? selection[row * stride + i] : -1;
      out[row * stride + i] = c >= 0 ? scores[row * score_stride + c] : kNegInf;
    }
  }
}

void ShadowkvGlobalSelect(const ShadowkvGlobalSelectArgs& a) {
  const int64_t n = static_cast<int64_t>(a.parts) * a.cand_stride;
  ParallelFor(a.rows, [&](int64_t row) {
    // The row's proposals of every part, in (part, index) order, and their
    // top-k as TopK orders it (ties to the lower index: the lower part).
    std::vector<float> all(n);
    for (int p = 0; p < a.parts; ++p)
      for (int i = 0; i < a.cand_stride; ++i)
        all[static_cast<size_t>(p) * a.cand_stride + i] = a.candidates[p * a.part_stride + row * a.cand_stride + i];
    int32_t* win = a.winners + row * a.k;
    TopKArgs t;
    t.values = all.data();
    t.stride = n;
    t.rows = 1;
    t.uniform_count = static_cast<int>(n);
    t.k = a.k;
    t.skip_worst_inf = true;
    t.out = win;
    t.out_stride = a.k;
    TopK(t);
    // This rank's winners (ascending, so its proposals' order) as chunk ids.
    int32_t* sel = a.selection + row * a.selection_stride;
    int m = 0;
    const int64_t lo = static_cast<int64_t>(a.rank) * a.cand_stride, hi = lo + a.cand_stride;
    for (int i = 0; i < a.k && win[i] >= 0; ++i) {
      if (win[i] < lo || win[i] >= hi) continue;
      CHECK_LT(m, a.selection_len) << "ShadowkvGlobalSelect: more winners than selection_len";
      sel[m++] = a.proposals[row * a.cand_stride + (win[i] - lo)];
    }
    for (; m < a.selection_len; ++m) sel[m] = -1;
  });
}

void MaxRows(const float* in, int rows, int64_t row_stride, int64_t cols, float* out, bool accumulate) {
  for (int64_t c = 0; c < cols; ++c) {
    float m = accumulate ? out[c] : kNegInf;
    for (int r = 0; r < rows; ++r) m = std::max(m, in[r * row_stride + c]);
    out[c] = m;
  }
}

void ShadowkvSlotUpdate(const ShadowkvSlotUpdateArgs& a) {
  const int ks = a.kslots;
  ParallelFor(static_cast<int64_t>(a.batch) * a.hkv, [&](int64_t row) {
    const int b = static_cast<int>(row / a.hkv), h = static_cast<int>(row % a.hkv);
    int32_t* map = a.slot_maps[b] + static_cast<int64_t>(h) * ks;
    const int32_t* sel_in = a.selection + row * a.selection_stride;
    auto valid = [&](int32_t c) { return c >= 0 && c < a.chunk_cap; };
    std::vector<char> in_prev(a.chunk_cap, 0), in_sel(a.chunk_cap, 0);
    for (int s = 0; s < ks; ++s)
      if (valid(map[s])) in_prev[map[s]] = 1;
    std::vector<int32_t> sel;
    if (a.force_keep < 0.0f) {
      for (int i = 0; i < ks; ++i)
        if (valid(sel_in[i])) sel.push_back(sel_in[i]);
    } else {
      const int keep = static_cast<int>(std::lround(static_cast<double>(a.force_keep) * ks));
      for (int s = 0; s < ks && static_cast<int>(sel.size()) < keep; ++s)
        if (valid(map[s])) sel.push_back(map[s]);
      for (int32_t c : sel) in_sel[c] = 1;
      for (int i = 0; i < ks && static_cast<int>(sel.size()) < ks; ++i)
        if (valid(sel_in[i]) && !in_prev[sel_in[i]]) sel.push_back(sel_in[i]);
      for (int i = 0; i < ks && static_cast<int>(sel.size()) < ks; ++i)
        if (valid(sel_in[i]) && in_prev[sel_in[i]] && !in_sel[sel_in[i]]) sel.push_back(sel_in[i]);
    }
    for (int32_t c : sel) in_sel[c] = 1;
    std::vector<int32_t> free_slots, misses;
    for (int s = 0; s < ks; ++s)
      if (!(valid(map[s]) && in_sel[map[s]])) free_slots.push_back(s);
    for (int32_t c : sel)
      if (!in_prev[c]) misses.push_back(c);
    CHECK_LE(misses.size(), free_slots.size());
    int32_t* mslot = a.miss_slot + row * ks;
    int32_t* mchunk = a.miss_chunk + row * ks;
    for (size_t i = 0; i < free_slots.size(); ++i) map[free_slots[i]] = i < misses.size() ? misses[i] : -1;
    for (int i = 0; i < ks; ++i) {
      const bool m = i < static_cast<int>(misses.size());
      mslot[i] = m ? free_slots[i] : -1;
      mchunk[i] = m ? misses[i] : -1;
    }
    a.miss_count[row] = static_cast<int32_t>(misses.size());
  });
}

void ShadowkvRebuildK(const ShadowkvRebuildKArgs& a) {
  const int half = a.d / 2;
  ParallelFor(static_cast<int64_t>(a.batch) * a.hkv, [&](int64_t row) {
    const int b = static_cast<int>(row / a.hkv), h = static_cast<int>(row % a.hkv);
    const float* bh = a.b[b] + static_cast<int64_t>(h) * a.r * a.d;
    const int32_t offset = a.position_offset ? a.position_offset[b] : 0;
    std::vector<float> x(a.d);
    for (int m = 0; m < a.miss_count[row]; ++m) {
      const int slot = a.miss_slot[row * a.miss_stride + m];
      const int chunk = a.miss_chunk[row * a.miss_stride + m];
      for (int i = 0; i < a.chunk_size; ++i) {
        const int64_t t = static_cast<int64_t>(chunk) * a.chunk_size + i;
        const int64_t split = static_cast<int64_t>(a.shared_chunks) * a.chunk_size;
        const float* at = t < split ? a.shared_a[b] + t * a.r : a.a[b] + (t - split) * a.r;
        // x = at . B, each x[j] summed over k in order (as before), with the
        // inner loop along B's contiguous rows so that it vectorizes.
        std::fill(x.begin(), x.end(), 0.0f);
        for (int k = 0; k < a.r; ++k) {
          const float ak = at[k];
          const float* bk = bh + static_cast<int64_t>(k) * a.d;
          for (int j = 0; j < a.d; ++j) x[j] += ak * bk[j];
        }
        const int32_t pos = static_cast<int32_t>(t) + offset;
        float* dst = a.att_k[b] + h * a.att_head_stride +
                     (static_cast<int64_t>(a.outlier_rows) + static_cast<int64_t>(slot) * a.chunk_size + i) * a.d;
        for (int j = 0; j < half; ++j) {
          const float angle = static_cast<float>(pos) * a.inv_freq[j];
          const float c = std::cos(angle), s = std::sin(angle);
          dst[j] = x[j] * c - x[j + half] * s;
          dst[j + half] = x[j + half] * c + x[j] * s;
        }
      }
    }
  });
}

void ShadowkvFetchV(const ShadowkvFetchVArgs& a) {
  const int64_t chunk_elems = static_cast<int64_t>(a.chunk_size) * a.d;
  const int64_t row_bytes =
      a.values_fp8 ? ValueRowBytesFp8(a.chunk_size, a.d) : chunk_elems * static_cast<int64_t>(sizeof(float));
  auto at = [&](const float* base, int64_t row) { return reinterpret_cast<const char*>(base) + row * row_bytes; };
  for (int64_t row = 0; row < static_cast<int64_t>(a.batch) * a.hkv; ++row) {
    const int b = static_cast<int>(row / a.hkv), h = static_cast<int>(row % a.hkv);
    for (int m = 0; m < a.miss_count[row]; ++m) {
      const int slot = a.miss_slot[row * a.miss_stride + m];
      const char* src;
      if (a.staging) {
        const int64_t base = a.staging_offsets ? a.staging_offsets[row] : row * a.miss_stride;
        src = at(a.staging, base + m);
      } else {
        const int chunk = a.miss_chunk[row * a.miss_stride + m];
        if (a.skip_shared && chunk < a.shared_chunks) continue;  // read in place by the attention
        if (chunk < a.shared_chunks) {
          src = at(a.shared_store[b], static_cast<int64_t>(h) * a.shared_stride + chunk);
        } else {
          src = at(a.value_store[b], static_cast<int64_t>(h) * a.chunk_cap + chunk - a.shared_chunks);
        }
      }
      float* dst = a.att_v[b] + h * a.att_head_stride +
                   (static_cast<int64_t>(a.outlier_rows) + static_cast<int64_t>(slot) * a.chunk_size) * a.d;
      if (a.values_fp8) {
        DecodeValueRowFp8(reinterpret_cast<const uint8_t*>(src), a.chunk_size, a.d, dst);
      } else {
        std::memcpy(dst, src, chunk_elems * sizeof(float));
      }
    }
  }
}

}  // namespace penumbra::kernels::cpu
