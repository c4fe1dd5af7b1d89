// SpindleKV's compression and decode merge on the device
// (worker/engine/spindlekv_device_policy.cc): the argument structs of the
// ops that turn a first prefill's exact keys and values into what a KV head
// holds (SpindlekvAttention's SpindlekvHead, spindlekv_args.h), and that merge
// a decode step's new keys and values into it. Plain pointers and ints, no
// CUDA header; the CUDA launchers are in spindlekv_compress.cuh and
// spindlekv_codebook.cuh, the CPU backend runs the host math of
// worker/engine/spindlekv_math.h, which defines the semantics:
//
//   WindowScores  spindlekv::WindowScores, for every query head at once
//   Select        spindlekv::TopKIndices per query head, then the union per
//                 KV head with each token's query-head mask
//   BuildCodebook spindlekv::BuildCodebook (Algorithm 1, blocked), for many
//                 (KV head, keys or values) problems at once
//   Merge         spindlekv::MergeOrAdd (two parts) of a decode step's rows
//
// All pointers are device memory (host memory on the CPU backend).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/spindlekv_args.h"

namespace penumbra::kernels {

// The observation window's accumulated attention, per query head:
// out[h][t] for t < n is spindlekv::WindowScores(q of head h, q_pos, w,
// keys of KV head h / (hq / hkv), n, d, scale, pool) (causal: row b sees keys
// t <= q_pos[b]; pooled with an odd window of `pool` tokens clipped at the
// ends). f32 logits and sums on the device (the CPU's row sums are f64).
struct SpindlekvWindowScoresArgs {
  const void* q = nullptr;         // [w][hq][d] of dtype, RoPE applied
  const int32_t* q_pos = nullptr;  // [w] ascending
  const void* k = nullptr;         // KV head g's token t at k + (g * head_stride + t * d) elements, dtype, RoPE applied
  int64_t head_stride = 0;         // elements (>= n * d)
  DType dtype = DType::kF32;       // q and k
  int w = 0, hq = 0, hkv = 0, d = 0;
  int64_t n = 0;  // keys 0..n-1, token t at position t
  float scale = 1.0f;
  int pool = 1;
  float* out = nullptr;        // [hq][n]
  float* workspace = nullptr;  // SpindlekvWindowScoresWorkspaceFloats floats (CUDA; null on the CPU)
};

inline size_t SpindlekvWindowScoresWorkspaceFloats(const SpindlekvWindowScoresArgs& a) {
  // Each (query head, window row)'s max and sum, and the unpooled scores.
  return static_cast<size_t>(a.hq) * a.w * 2 + static_cast<size_t>(a.hq) * static_cast<size_t>(a.n);
}

// The tokens each KV head holds after eviction: query head h keeps
// spindlekv::TopKIndices(scores[h], context, keep) (ties: the lower index;
// NaN below every number) and every token of [context, n) (the window); a KV
// head g holds the union of its query heads' (h = g * G + j, G = hq / hkv),
// ascending, each with the mask of the j that keep it (bit j).
// keep >= context: every token is kept by every query head (scores unused,
// may be null).
struct SpindlekvSelectArgs {
  const float* scores = nullptr;  // [hq][n]
  int64_t n = 0;
  int64_t context = 0;  // tokens [0, context) are ranked
  int64_t keep = 0;     // per query head, of the context
  int hq = 0, hkv = 0;
  int32_t* held = nullptr;    // out [hkv]: how many tokens KV head g holds
  int32_t* pos = nullptr;     // out [hkv][n] (row g at g * n): the held tokens, ascending
  uint32_t* heads = nullptr;  // out [hkv][n]: their masks
  void* workspace = nullptr;  // SpindlekvSelectWorkspaceBytes bytes (CUDA; null on the CPU)
};

inline size_t SpindlekvSelectWorkspaceBytes(const SpindlekvSelectArgs& a) {
  // Each query head's threshold: the 64-bit rank key of its keep-th token.
  return static_cast<size_t>(a.hq) * sizeof(uint64_t);
}

// One codebook to build: n rows of d elements taken by index from a strided
// source (row i is x + rows[i] * row_stride elements), appended to an empty
// codebook (entries [n][d] at most), each row's reference and magnitude
// written, and the number of entries made.
struct SpindlekvCodebookProblem {
  const void* x = nullptr;        // of SpindlekvCodebookArgs::x_dtype
  int64_t row_stride = 0;         // elements
  const int32_t* rows = nullptr;  // [n]
  int32_t n = 0;
  float theta = 0.0f;              // cosine similarity strictly above it merges
  void* entries = nullptr;         // out [n][d] of SpindlekvCodebookArgs::entry_dtype (room for n)
  int32_t* refs = nullptr;         // out [n]
  float* mags = nullptr;           // out [n]
  int32_t* entry_count = nullptr;  // out [1]
};

// spindlekv::BuildCodebook(rows of problem p, n, d, theta, block, empty
// codebook) for each of `count` problems: the same graph, the same entries in
// the same order (each row's unit vector rounded to entry_dtype), the same
// references; magnitudes and similarities in f32 (a similarity within
// rounding of theta may fall the other way than on the CPU).
struct SpindlekvCodebookArgs {
  const SpindlekvCodebookProblem* problems = nullptr;  // [count]
  int count = 0;
  int d = 0;
  int block = 1024;  // rows per block (<= 0: all of a problem's rows, CPU only; CUDA takes 1..1024)
  DType x_dtype = DType::kF32, entry_dtype = DType::kF32;
  int32_t max_n = 0;          // max n over the problems
  void* workspace = nullptr;  // SpindlekvCodebookWorkspaceBytes bytes (CUDA; null on the CPU)
};

inline size_t SpindlekvCodebookWorkspaceBytes(const SpindlekvCodebookArgs& a) {
  // Per (problem, block): its entry count and its entries' source rows.
  const int b = a.block > 0 ? a.block : 1;
  const size_t blocks = (static_cast<size_t>(a.max_n) + b - 1) / b;
  return static_cast<size_t>(a.count) * (blocks + 1) * sizeof(int32_t) +
         static_cast<size_t>(a.count) * static_cast<size_t>(a.max_n) * sizeof(int32_t);
}

// A decode step's merge, for `batch` sequences at one layer. Sequence i
// keeps its heads of every layer in one array, seq_heads[i][layer * hkv + g]
// (the views SpindlekvAttention reads), and its own codebooks' entry counts
// in seq_entries[i][(layer * hkv + g) * 2 + {0: keys, 1: values}]. For each
// (i, g): the new token's pre-RoPE key (qkv row i at (hq + g) * d) and value
// (at (hq + hkv + g) * d) merge by spindlekv::MergeOrAdd (over the last
// `window` entries) into the KV head's
// two-part codebooks (part 0's entries, key_base_entries of them, read only;
// new entries appended to part 1's at its count, which grows), and the token
// is appended to part 1's tokens at index part[1].n (position positions[i],
// the references and magnitudes, every query head of the group in its mask),
// then part[1].n grows by one. The policy sized part 1 for every token it
// will hold. `gathered` (optional) receives the updated views [batch * hkv]
// (row i * hkv + g), what SpindlekvAttention takes for this layer.
struct SpindlekvMergeArgs {
  SpindlekvHead* const* seq_heads = nullptr;  // [batch]
  int32_t* const* seq_entries = nullptr;      // [batch]
  const float* qkv = nullptr;                 // [batch][(hq + 2 hkv) d] f32
  const int32_t* positions = nullptr;         // [batch]
  SpindlekvHead* gathered = nullptr;          // optional out [batch * hkv]
  DType entry_dtype = DType::kF32;            // the codebooks' entries
  int layer = 0, batch = 0, hq = 0, hkv = 0, d = 0;
  float key_theta = 0.0f, value_theta = 0.0f;
  int32_t window = 0;  // the search covers the last `window` entries of the two parts (0: all)
  // CUDA: each codebook's search is split over `splits` blocks, their bests
  // met in `workspace` (SpindlekvMergeWorkspaceBytes bytes); null on the CPU.
  int splits = 1;
  void* workspace = nullptr;
};

inline size_t SpindlekvMergeWorkspaceBytes(const SpindlekvMergeArgs& a) {
  // A (similarity, entry) pair per (sequence, KV head, keys or values, split).
  return static_cast<size_t>(a.batch) * a.hkv * 2 * a.splits * 8;
}

}  // namespace penumbra::kernels
