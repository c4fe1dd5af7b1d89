// SpindleKV's host math (spindlekv_math.h says what each function computes).
//
// BuildCodebook, per block of B rows: the rows are normalized (f64 norms), the
// block's cosine similarities are its Gram matrix computed as a tiled product
// (4 rows x 16 columns of accumulators, the block transposed so the inner loop
// over columns vectorizes; each dot product is a sequential f32 sum over the d
// components, the same value a plain loop gives), only the upper triangle,
// thresholded straight into a symmetric adjacency bitset (B^2 bits). The
// greedy then keeps a degree per row and an `alive` bitset: each round scans
// the alive rows for the highest degree, takes its alive neighbours out, and
// for each row taken out decrements the degree of its alive neighbours (each
// edge is visited once per direction over the whole greedy). Time per block:
// B^2 d / 2 multiply-adds for the Gram matrix, O(B^2 / 64 + edges) for the
// updates and O(B) per round for the argmax.
#include "worker/engine/spindlekv_math.h"

#include <glog/logging.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <numeric>

namespace penumbra::spindlekv {
namespace {

// a.b with 8 partial sums (vectorizes without reassociation flags).
float Dot(const float* a, const float* b, int d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= d; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (; i < d; ++i) acc[i & 7] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// The L2 norm of v[d], accumulated in f64.
double Norm(const float* v, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += static_cast<double>(v[i]) * v[i];
  return std::sqrt(s);
}

// A row with a direction: a finite, positive norm.
bool HasDirection(double norm) { return std::isfinite(norm) && norm > 0; }

// Appends e_0 = (1, 0, ..., 0) to cb (the entry of zero rows when there is no other).
int32_t AppendE0(Codebook* cb) {
  const int32_t e = cb->size();
  cb->entries.resize(cb->entries.size() + cb->d, 0.0f);
  cb->entries[static_cast<size_t>(e) * cb->d] = 1.0f;
  return e;
}

constexpr int kTileRows = 4;
constexpr int kTileCols = 16;

// Algorithm 1 on one block: rows x[0..B) (global indices base + i), appending to cb. Zero rows are left with
// refs = -1 for the caller.
class BlockGreedy {
 public:
  BlockGreedy(int d, float theta) : d_(d), theta_(theta) {}

  void Run(const float* x, int B, Codebook* cb, int32_t* refs, float* mags) {
    Prepare(x, B, mags);
    Gram();
    Greedy(cb, refs);
  }

 private:
  // Normalized rows u_ [Bp][d] and their transpose ut_ [d][Bp] (Bp: B rounded up to a tile; padding is 0).
  void Prepare(const float* x, int B, float* mags) {
    B_ = B;
    Bp_ = (B + kTileCols - 1) / kTileCols * kTileCols;
    W_ = (B + 63) / 64;
    u_.assign(static_cast<size_t>(Bp_) * d_, 0.0f);
    ut_.assign(static_cast<size_t>(d_) * Bp_, 0.0f);
    dir_.assign(B, 0);
    for (int i = 0; i < B; ++i) {
      const float* row = x + static_cast<size_t>(i) * d_;
      const double norm = Norm(row, d_);
      mags[i] = static_cast<float>(norm);
      if (!HasDirection(norm)) continue;
      dir_[i] = 1;
      float* ui = &u_[static_cast<size_t>(i) * d_];
      for (int c = 0; c < d_; ++c) {
        ui[c] = static_cast<float>(row[c] / norm);
        ut_[static_cast<size_t>(c) * Bp_ + i] = ui[c];
      }
    }
  }

  // adj_ [B][W]: bit j of row i set when i == j or cos(i, j) > theta (rows with a direction only).
  void Gram() {
    adj_.assign(static_cast<size_t>(B_) * W_, 0);
    for (int i = 0; i < B_; ++i) {
      if (dir_[i]) SetBit(i, i);
    }
    for (int i0 = 0; i0 < B_; i0 += kTileRows) {
      for (int j0 = i0 / kTileCols * kTileCols; j0 < B_; j0 += kTileCols) {
        float acc[kTileRows][kTileCols] = {};
        const float* a = &u_[static_cast<size_t>(i0) * d_];
        for (int k = 0; k < d_; ++k) {
          const float* b = &ut_[static_cast<size_t>(k) * Bp_ + j0];
          for (int r = 0; r < kTileRows; ++r) {
            const float ar = a[static_cast<size_t>(r) * d_ + k];
            for (int c = 0; c < kTileCols; ++c) acc[r][c] += ar * b[c];
          }
        }
        for (int r = 0; r < kTileRows && i0 + r < B_; ++r) {
          const int i = i0 + r;
          if (!dir_[i]) continue;
          for (int c = 0; c < kTileCols; ++c) {
            const int j = j0 + c;
            if (j <= i || j >= B_ || !dir_[j] || !(acc[r][c] > theta_)) continue;
            SetBit(i, j);
            SetBit(j, i);
          }
        }
      }
    }
  }

  void Greedy(Codebook* cb, int32_t* refs) {
    std::vector<uint64_t> alive(W_, 0), taken(W_);
    std::vector<int32_t> deg(B_, 0);
    for (int i = 0; i < B_; ++i) {
      if (!dir_[i]) continue;
      alive[i >> 6] |= uint64_t{1} << (i & 63);
      const uint64_t* row = Row(i);
      int s = 0;
      for (int w = 0; w < W_; ++w) s += __builtin_popcountll(row[w]);
      deg[i] = s;
    }
    for (;;) {
      int best = -1, best_deg = -1;
      for (int w = 0; w < W_; ++w) {
        for (uint64_t m = alive[w]; m; m &= m - 1) {
          const int i = w * 64 + __builtin_ctzll(m);
          if (deg[i] > best_deg) best_deg = deg[i], best = i;
        }
      }
      if (best < 0) break;
      CHECK_LT(cb->size(), std::numeric_limits<int32_t>::max()) << "codebook too large for int32 references";
      const int32_t e = cb->size();
      const float* ub = &u_[static_cast<size_t>(best) * d_];
      cb->entries.insert(cb->entries.end(), ub, ub + d_);
      const uint64_t* brow = Row(best);
      for (int w = 0; w < W_; ++w) {
        taken[w] = brow[w] & alive[w];
        alive[w] &= ~taken[w];
      }
      for (int w = 0; w < W_; ++w) {
        for (uint64_t m = taken[w]; m; m &= m - 1) {
          const int r = w * 64 + __builtin_ctzll(m);
          refs[r] = e;
          const uint64_t* rrow = Row(r);
          for (int v = 0; v < W_; ++v) {
            for (uint64_t n = rrow[v] & alive[v]; n; n &= n - 1) --deg[v * 64 + __builtin_ctzll(n)];
          }
        }
      }
    }
  }

  uint64_t* Row(int i) { return &adj_[static_cast<size_t>(i) * W_]; }
  void SetBit(int i, int j) { Row(i)[j >> 6] |= uint64_t{1} << (j & 63); }

  const int d_;
  const float theta_;
  int B_ = 0, Bp_ = 0, W_ = 0;
  std::vector<float> u_, ut_;
  std::vector<uint8_t> dir_;
  std::vector<uint64_t> adj_;
};

}  // namespace

std::vector<double> RetainRatios(double r, int64_t prompt, int64_t window, double beta, int layers) {
  if (layers <= 0) return {};
  if (prompt <= window) return std::vector<double>(layers, 1.0);
  beta = std::clamp(beta, 0.0, 1.0);
  const double rc = std::clamp(
      (r * static_cast<double>(prompt) - static_cast<double>(window)) / static_cast<double>(prompt - window), 0.0, 1.0);
  const double alpha = (1.0 + beta) / 2.0;
  if (layers == 1 || rc <= beta) return std::vector<double>(layers, rc);
  double first, last;
  if (rc <= alpha) {
    first = 2.0 * rc - beta;
    last = beta;
  } else {
    first = 1.0;
    last = 2.0 * rc - 1.0;
  }
  std::vector<double> out(layers);
  for (int l = 0; l < layers; ++l) out[l] = first + (last - first) * l / (layers - 1);
  out.back() = last;
  return out;
}

std::vector<double> LayerRatios(double r, double beta, int64_t first, int64_t window, int64_t min_prompt, int layers) {
  return first >= min_prompt ? RetainRatios(r, first, window, beta, layers)
                             : std::vector<double>(std::max(layers, 0), 1.0);
}

int64_t KeptTokens(double ratio, int64_t context) {
  if (context <= 0 || !(ratio > 0)) return 0;
  const double kept = std::floor(ratio * static_cast<double>(context) + 1e-9);
  if (kept >= static_cast<double>(context)) return context;
  return static_cast<int64_t>(kept);
}

void WindowScores(const float* q, const int32_t* q_pos, int w, const float* k, int64_t n, int d, float scale, int pool,
                  float* out) {
  if (n <= 0) return;
  std::fill(out, out + n, 0.0f);
  if (w > 0) {
    // Each row's last visible key (-1: none) and its logits, [w][n], filled a tile of keys at a time so the
    // tile stays in cache across the rows.
    std::vector<int64_t> last(w);
    for (int b = 0; b < w; ++b) last[b] = std::min<int64_t>(q_pos[b], n - 1);
    std::vector<float> logits(static_cast<size_t>(w) * n);
    constexpr int64_t kKeyTile = 64;
    for (int64_t t0 = 0; t0 < n; t0 += kKeyTile) {
      const int64_t t1 = std::min(n, t0 + kKeyTile);
      for (int b = 0; b < w; ++b) {
        const float* qb = q + static_cast<size_t>(b) * d;
        float* lb = &logits[static_cast<size_t>(b) * n];
        const int64_t end = std::min(t1, last[b] + 1);
        for (int64_t t = t0; t < end; ++t) lb[t] = scale * Dot(qb, k + static_cast<size_t>(t) * d, d);
      }
    }
    for (int b = 0; b < w; ++b) {
      const int64_t end = last[b] + 1;
      if (end <= 0) continue;
      float* lb = &logits[static_cast<size_t>(b) * n];
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < end; ++t) mx = std::max(mx, lb[t]);
      if (!std::isfinite(mx)) continue;
      double sum = 0;
      for (int64_t t = 0; t < end; ++t) {
        lb[t] = std::exp(lb[t] - mx);
        sum += lb[t];
      }
      const double inv = 1.0 / sum;
      for (int64_t t = 0; t < end; ++t) out[t] += static_cast<float>(lb[t] * inv);
    }
  }
  if (pool > 1) {
    const int64_t half = pool / 2;
    std::vector<double> prefix(n + 1, 0.0);
    for (int64_t t = 0; t < n; ++t) prefix[t + 1] = prefix[t] + out[t];
    for (int64_t t = 0; t < n; ++t) {
      const int64_t lo = std::max<int64_t>(0, t - half), hi = std::min<int64_t>(n - 1, t + half);
      out[t] = static_cast<float>((prefix[hi + 1] - prefix[lo]) / static_cast<double>(hi - lo + 1));
    }
  }
}

std::vector<int32_t> TopKIndices(const float* scores, int64_t n, int64_t k) {
  n = std::max<int64_t>(n, 0);
  k = std::clamp<int64_t>(k, 0, n);
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  if (k == n) return idx;
  // Rank: higher score first, NaN last, then lower index first (a strict weak order).
  auto before = [scores](int32_t a, int32_t b) {
    const float sa = scores[a], sb = scores[b];
    const bool na = std::isnan(sa), nb = std::isnan(sb);
    if (na != nb) return nb;
    if (!na && sa != sb) return sa > sb;
    return a < b;
  };
  if (k > 0) std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(), before);
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

void BuildCodebook(const float* x, int64_t n, int d, float theta, int block, Codebook* cb, int32_t* refs, float* mags) {
  CHECK_GT(d, 0);
  if (cb->d == 0) cb->d = d;
  CHECK_EQ(cb->d, d) << "codebook of another dimension";
  if (n <= 0) return;
  const int64_t bs = block > 0 ? std::min<int64_t>(block, n) : n;
  CHECK_LE(bs, std::numeric_limits<int>::max());
  std::fill(refs, refs + n, -1);
  BlockGreedy greedy(d, theta);
  for (int64_t b0 = 0; b0 < n; b0 += bs) {
    const int B = static_cast<int>(std::min(bs, n - b0));
    greedy.Run(x + static_cast<size_t>(b0) * d, B, cb, refs + b0, mags + b0);
  }
  // Zero rows (the only ones left unassigned): entry 0, e_0 when there is none.
  for (int64_t i = 0; i < n; ++i) {
    if (refs[i] >= 0) continue;
    if (cb->size() == 0) AppendE0(cb);
    refs[i] = 0;
  }
}

int32_t MergeOrAdd(const float* v, float theta, Codebook* cb, float* mag, int64_t window) {
  return MergeOrAdd(v, theta, nullptr, cb, mag, window);
}

int32_t MergeOrAdd(const float* v, float theta, const Codebook* base, Codebook* own, float* mag, int64_t window) {
  const int d = own->d;
  CHECK_GT(d, 0) << "MergeOrAdd needs the codebook's dimension";
  CHECK(base == nullptr || base->size() == 0 || base->d == d) << "codebook parts of other dimensions";
  const int32_t nb = base != nullptr ? base->size() : 0;
  int32_t n = own->size();
  CHECK_LT(nb + n, std::numeric_limits<int32_t>::max()) << "codebook too large for int32 references";
  own->entries.resize(static_cast<size_t>(n + 1) * d);  // room for the entry it may add
  const int32_t ref =
      MergeOrAdd(v, d, theta, nb ? base->entries.data() : nullptr, nb, own->entries.data(), &n, mag, window);
  own->entries.resize(static_cast<size_t>(n) * d);
  return ref;
}

int32_t MergeOrAdd(const float* v, int d, float theta, const float* base, int32_t nb, float* own, int32_t* own_n,
                   float* mag, int64_t window) {
  const double norm = Norm(v, d);
  *mag = static_cast<float>(norm);
  if (!HasDirection(norm) && nb + *own_n > 0) return 0;
  float* added = own + static_cast<size_t>(*own_n) * d;
  if (!HasDirection(norm)) {  // the first entry of an empty codebook: e_0
    std::fill(added, added + d, 0.0f);
    added[0] = 1.0f;
    return nb + (*own_n)++;
  }
  std::vector<float> u(d);
  for (int c = 0; c < d; ++c) u[c] = static_cast<float>(v[c] / norm);
  int32_t best = -1;
  float best_sim = -std::numeric_limits<float>::infinity();
  const int32_t total = nb + *own_n;
  const int32_t first = window > 0 && window < total ? total - static_cast<int32_t>(window) : 0;
  for (int32_t e = first; e < total; ++e) {
    const float s =
        Dot(e < nb ? base + static_cast<size_t>(e) * d : own + static_cast<size_t>(e - nb) * d, u.data(), d);
    if (s > best_sim) best_sim = s, best = e;
  }
  if (best >= 0 && best_sim > theta) return best;
  std::copy(u.begin(), u.end(), added);
  return nb + (*own_n)++;
}

void SelectHeld(const float* scores, int64_t n, int64_t context, int64_t keep, int hq, int hkv,
                std::vector<std::vector<int32_t>>* pos, std::vector<std::vector<uint32_t>>* heads) {
  const int group = hq / hkv;
  context = std::clamp<int64_t>(context, 0, n);
  std::vector<std::vector<int32_t>> kept(hq);
  for (int h = 0; h < hq; ++h) {
    std::vector<int32_t>& mine = kept[h];
    if (keep < context) {
      mine = TopKIndices(scores + static_cast<size_t>(h) * n, context, keep);
    } else {
      mine.resize(context);
      std::iota(mine.begin(), mine.end(), 0);
    }
    for (int64_t t = context; t < n; ++t) mine.push_back(static_cast<int32_t>(t));
  }
  pos->assign(hkv, {});
  heads->assign(hkv, {});
  for (int g = 0; g < hkv; ++g) {
    std::vector<int32_t>& held = (*pos)[g];
    for (int j = 0; j < group; ++j) {
      const auto& k = kept[g * group + j];
      std::vector<int32_t> merged;
      std::set_union(held.begin(), held.end(), k.begin(), k.end(), std::back_inserter(merged));
      held.swap(merged);
    }
    std::vector<uint32_t>& mask = (*heads)[g];
    mask.assign(held.size(), 0);
    for (int j = 0; j < group; ++j) {
      for (int32_t tok : kept[g * group + j]) {
        mask[std::lower_bound(held.begin(), held.end(), tok) - held.begin()] |= uint32_t{1} << j;
      }
    }
  }
}

void Reconstruct(const Codebook& cb, int32_t ref, float mag, float* out) {
  const float* e = cb.entry(ref);
  for (int c = 0; c < cb.d; ++c) out[c] = e[c] * mag;
}

}  // namespace penumbra::spindlekv
