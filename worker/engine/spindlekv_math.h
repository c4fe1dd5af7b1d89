// The host-side math of SpindleKV (Tang et al., "SpindleKV: A Novel KV Cache
// Reduction Method Balancing Both Shallow and Deep Layers", sections 3.3-3.4,
// Algorithm 1), on plain float arrays; the policy that applies it to a
// sequence's state is worker/engine/spindlekv_policy.cc.
//
//   - eviction (3.3): per-layer retain ratios of the context in a linear
//     pyramid (RetainRatios, KeptTokens), the observation window's
//     accumulated attention (WindowScores, SnapKV-style) and the top tokens
//     by it (TopKIndices);
//   - replacement (3.4): a codebook of unit vectors per KV head for keys and
//     one for values; each token keeps a reference and its magnitude
//     (BuildCodebook at prefill, MergeOrAdd at decode, Reconstruct: eq. 14).
//
// Every function is pure (no global state) and safe to call concurrently on
// distinct outputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace penumbra::spindlekv {

// Per-layer retain ratios of the context (the prompt less the observation
// window), the paper's eq. 5-6: r is the total reserve ratio of a prompt of
// `prompt` tokens with a window of `window` tokens, beta the minimal ratio.
// r_c = (r*prompt - window) / (prompt - window), clamped to [0, 1];
// alpha = (1 + beta) / 2;
//   beta < r_c <= alpha: first = 2*r_c - beta, last = beta   (the paper writes 0.05 for beta, its value)
//   alpha < r_c <= 1:    first = 1, last = 2*r_c - 1   (the paper prints "1 - 2 r_c", a typo: the mean must be r_c)
//   r_c <= beta:         every layer r_c (the schedule cannot go below its minimum)
// then linear interpolation first..last over `layers` layers (one layer: r_c). prompt <= window: every layer 1.
// The mean over layers is r_c in every case; the ratios never increase with depth. layers <= 0: empty.
std::vector<double> RetainRatios(double r, int64_t prompt, int64_t window, double beta, int layers);

// The retain ratios of a first prefill of `first` tokens with a window of `window`: RetainRatios when it
// evicts (first >= min_prompt), else 1 in every layer (everything kept).
std::vector<double> LayerRatios(double r, double beta, int64_t first, int64_t window, int64_t min_prompt, int layers);

// Tokens of the context a layer keeps per query head: floor(ratio * context), at least 0, at most context.
// (A product within 1e-9 below an integer counts as that integer, so 0.3 * 200 is 60 whatever the rounding
// of the interpolated ratio; a NaN ratio keeps nothing.)
int64_t KeptTokens(double ratio, int64_t context);

// Accumulated attention of an observation window (SnapKV-style) for one query head:
//   q: [w][d] the window's queries (RoPE applied), at positions q_pos[w] (ascending);
//   k: [n][d] keys (RoPE applied) of tokens 0..n-1 at positions 0..n-1 (token t at position t);
//   scale: softmax scale.
// For each window row b: softmax over keys t <= q_pos[b] of scale*q_b.k_t (causal); out[t] = sum over rows
// of those probabilities (out has n entries; keys never seen by any row get 0; a row with q_pos < 0 sees
// nothing and adds nothing).
// Then, if pool > 1, out is replaced by its average pooling with an odd window `pool` centred on each token
// (clipped at the ends: divided by the number of tokens actually in the window), as SnapKV does so that a
// kept token's neighbours come with it; an even pool counts as pool + 1 (pool / 2 tokens on each side).
// Numerically stable (the row max is subtracted); f32 logits, f64 row sums.
void WindowScores(const float* q, const int32_t* q_pos, int w, const float* k, int64_t n, int d, float scale, int pool,
                  float* out);

// Indices of the `k` largest of scores[0..n), ascending by index (ties: the lower index wins), k clamped to [0, n].
// NaN scores rank below every number.
std::vector<int32_t> TopKIndices(const float* scores, int64_t n, int64_t k);

// A codebook of unit vectors of dimension d (one per KV head, for keys or for values), Algorithm 1.
struct Codebook {
  int d = 0;
  std::vector<float> entries;  // [size()][d], each of L2 norm 1
  int32_t size() const { return d ? static_cast<int32_t>(entries.size() / d) : 0; }
  const float* entry(int32_t i) const { return entries.data() + static_cast<size_t>(i) * d; }
};

// Builds codebook entries for x: [n][d] (rows in token order), appending to *cb (which may already hold
// entries; new rows are NOT matched against existing ones here) with threshold theta (cosine similarity
// strictly greater than theta merges). Writes refs[n] (index into cb, counting existing entries) and
// mags[n] (each row's L2 norm). cb->d is set to d when it is 0 and must equal d otherwise.
//
// Algorithm 1, blocked: the rows are cut into consecutive blocks of `block` rows (block <= 0: one block of
// all n) and inside each block: S = cos_sim of all pairs, G = S > theta (every row adjacent to itself),
// then repeatedly the remaining row of highest degree in G (ties: the lowest index) becomes an entry (its
// normalized vector), every remaining row adjacent to it (and itself) references that entry and leaves the
// graph (the remaining rows' degrees drop accordingly), until no row remains (an isolated row becomes its own
// entry). Entries are appended in the order they are chosen. Rows of different blocks never share an
// entry. With block >= n it is exactly the paper's algorithm; blocked it takes O(n * block * d) time and
// O(block^2) bits.
//
// A zero row (norm 0) has no direction: it gets magnitude 0, takes no part in the graph and references
// entry 0 of *cb (any entry reconstructs it exactly); only when *cb would otherwise end up empty (every row
// zero and no existing entry) is the unit vector e_0 = (1, 0, ..., 0) appended for it. A row whose norm is
// not finite is treated the same way (its magnitude is that norm).
void BuildCodebook(const float* x, int64_t n, int d, float theta, int block, Codebook* cb, int32_t* refs, float* mags);

// Decode-time merge of one new row v[d] (the paper: "we first search for suitable CodeBook entries ...
// if found we merge them; otherwise [a new entry]"): the entry of highest cosine similarity (ties: the
// lowest index) among the last `window` entries (0: all of them); if it is > theta the row references it,
// else v/|v| is appended as a new entry. Returns the reference; *mag = |v|. v has cb->d floats: cb->d must
// be set (> 0) even while cb is empty. A zero row references entry 0 (e_0 is appended first when cb is
// empty).
int32_t MergeOrAdd(const float* v, float theta, Codebook* cb, float* mag, int64_t window = 0);
// The same over a codebook in two parts: `base` (may be null; an attached document's, read only) followed
// by `own`, where new entries go. References count base's entries first (own's entry i is base->size() + i);
// the window is over both (base's entries come first).
int32_t MergeOrAdd(const float* v, float theta, const Codebook* base, Codebook* own, float* mag, int64_t window = 0);

// The same over entries in the caller's memory: base [nb][d] (read only; may be null when nb is 0) and
// own [*own_n][d] with room for one more entry, appended there (*own_n grows) when the row adds one.
int32_t MergeOrAdd(const float* v, int d, float theta, const float* base, int32_t nb, float* own, int32_t* own_n,
                   float* mag, int64_t window = 0);

// The tokens each KV head holds after eviction: query head h keeps TopKIndices(scores + h * n, context,
// keep) (every context token when keep >= context; scores may then be null) and every token of
// [context, n) (the observation window); KV head g (query heads g * G + j, G = hq / hkv) holds the union
// of its query heads' tokens, ascending, in (*pos)[g], each with the mask of the j that keep it (bit j)
// in (*heads)[g].
void SelectHeld(const float* scores, int64_t n, int64_t context, int64_t keep, int hq, int hkv,
                std::vector<std::vector<int32_t>>* pos, std::vector<std::vector<uint32_t>>* heads);

// The reconstruction of eq. 14: out[d] = cb.entry(ref) * mag.
void Reconstruct(const Codebook& cb, int32_t ref, float mag, float* out);

}  // namespace penumbra::spindlekv
