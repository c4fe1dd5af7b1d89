// ShadowKV decode step (seed paper, Algorithm 2), batched over sequences: the
// kernels' argument structs (plain pointers and ints, no CUDA header; the
// launchers are in shadowkv_decode.cuh, one .cu per stage: shadowkv_score.cu,
// shadowkv_slot_update.cu, shadowkv_rebuild_k.cu, shadowkv_fetch_v.cu).
//
// Per sequence and layer the caller holds (dtype T = bf16, or f32 for tests):
//   landmarks L [hkv][chunk_cap] records of S rows of d T (or fp8 codes and a
//               scale: kernels/landmark_format.h), n_chunks valid for every head;
//   excluded    [hkv][chunk_cap] uint8, 1 = outlier chunk of that head (never
//               selectable, not in the softmax denominator);
//   A [token_cap][r] T (low-rank pre-RoPE key coordinates, row t = token t);
//   B [hkv][r][d] T (singular values folded in): pre-RoPE key of token t,
//               head h = A[t,:] . B[h];
//   attention buffers K, V [hkv][att_cap][d] T: rows [0, O*C) outliers, then
//               kslots slots of C rows (slot j = rows O*C + j*C ..), then the
//               local window;
//   slot map [hkv][kslots] int32 chunk id per slot, -1 = empty;
//   value store [hkv][chunk_cap][C*d] T in pinned, mapped host memory.
// Per-sequence tensors are passed as device arrays of per-sequence base
// pointers; "row" below means (sequence b, KV head h) = b * hkv + h.
//
// One step: ShadowkvScore with its selection (the top-k of topk.cuh, k =
// kslots, skip_worst_inf so excluded chunks are never picked) ->
// ShadowkvSlotUpdate -> on two streams ShadowkvRebuildK and
// ShadowkvFetchV (or ShadowkvScatterV) -> attention. A slot whose map entry
// is -1 (fewer selectable chunks than kslots) holds stale K/V rows: attention
// must mask it.
//
// Kernels and expected traffic:
//  Score: grid (chunk split, kv head, sequence); each block reads its split of
//    L once with 16-byte loads and serves the whole query group (G = hq/hkv),
//    writing scaled logits and per-split (max, sum exp) to the workspace; a
//    small kernel merges the split statistics per query head; a last pass
//    writes max over the group of exp(logit - max) / sum. Reads L once
//    (B*hkv*n*S*d elements: 1 byte each for fp8 records, plus a 16-byte
//    scale per chunk) plus 2 passes over B*hq*n*S f32 logits. fp8 codes
//    become bf16 (tensor cores) or f32 (SIMT) by moving their bit fields
//    (exact, times 2^-120, folded into the logit with the scale). With a
//    selection, one block per row (1024 threads) merges its heads' statistics,
//    computes the row's scores from the logits into shared memory as top-k
//    keys and selects (one pass over the logits, two launches fewer).
//  RebuildK: grid (tile split, row); a block stages B[h] in shared memory
//    once and loops over tiles of 64 miss tokens: gathers A rows (cp.async,
//    the next tile's in flight), multiplies on tensor cores (mma.sync bf16,
//    f32 accumulate), applies rotate-half RoPE in f32 on the accumulators and
//    writes the K rows. A SIMT path (f32 FMA) serves f32 and shapes the
//    tensor-core path does not cover (d % 64 != 0, r % 8 != 0, B too large).
//  Context parallel's two-call score (stats_out, then stats_in after the
//    statistics' exchange): the first runs phase 1 and the split merge only;
//    the second skips phase 1 (the logits stay in the workspace) and combines
//    the parts' statistics where the split statistics were merged.
//  GlobalSelect: one block per row, the top-k of the row's parts * cand_stride
//    proposal scores (block top-k, keys in shared memory when they fit), this
//    rank's run of winners mapped to chunk ids, then the fused slot update.
//  SlotUpdate: one block per row; shared-memory bitmaps over chunk ids.
//  FetchV / ScatterV: a warp per missed chunk, 16-byte loads, all of a lane's
//    loads issued before its stores (PCIe latency).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/topk_args.h"

namespace penumbra::kernels {

// ---- 1. chunk scores --------------------------------------------------------
// scores[b][h][c] = max over the query heads g of KV head h of
//   softmax_c'(q_g . L[h][c'] * scale)[c], the softmax over the chunks
//   c' < n_chunks[b] that are not excluded. Excluded chunks and chunks in
//   [n_chunks[b], max_chunks) get -inf; entries >= max_chunks are untouched.
// Supported: d % 8 == 0, d <= 256; hq % hkv == 0 and hq / hkv <= 8.
struct ShadowkvScoreArgs {
  const void* q = nullptr;  // [batch, hq, d] of q_dtype (f32 or bf16)
  DType q_dtype = DType::kBF16;
  const void* const* landmarks = nullptr;    // device [batch] -> [hkv][chunk_cap] chunk records (below)
  const uint8_t* const* excluded = nullptr;  // device [batch] -> [hkv][chunk_cap]; null: none excluded
  DType dtype = DType::kBF16;                // landmarks: f32 or bf16 (ignored with landmark_fp8)
  // Landmarks as fp8 records (kernels/landmark_format.h): each chunk's
  // landmarks_per_chunk rows of e4m3 codes and their scale; a row's logit is
  // q . codes * scale * `scale`. Needs d % 16 == 0 for the tensor-core path
  // (bf16 q, d 64 or 128), d % 8 otherwise. Either way chunk c's record is at
  // c * LandmarkChunkElems(landmarks_per_chunk, d, landmark_fp8) elements.
  bool landmark_fp8 = false;
  const int32_t* n_chunks = nullptr;  // device [batch], each <= max_chunks
  int batch = 0, hq = 0, hkv = 0, d = 0;
  int chunk_cap = 0;  // chunks allocated per head in excluded (and in landmarks unless landmark_cap > 0)
  // Chunks below shared_chunks have their landmarks at shared_landmarks[b]
  // ([hkv][shared_chunks] records: an attached prefix's, read by every
  // sequence attached to it); chunk c >= shared_chunks at landmarks[b]
  // record c - shared_chunks of landmark_cap records per head.
  const void* const* shared_landmarks = nullptr;  // device [batch]; may be null when shared_chunks == 0
  int shared_chunks = 0;
  int landmark_cap = 0;  // 0: chunk_cap
  int max_chunks = 0;    // host-side upper bound of n_chunks (sizes the grid), <= chunk_cap
  float scale = 1.0f;    // usually 1/sqrt(d)
  // > 0: a selectable chunk scores as high as its best of the `successors`
  // chunks before it too (score'(c) = max over 0 <= j <= successors, c - j
  // >= 0, of score(c - j); excluded chunks stay -inf and pass nothing on), so
  // a selected chunk brings the chunks after it: a run of text the answer
  // copies continues past its first chunk's end. Applies to scores, the
  // selection and selection_scores alike.
  int successors = 0;
  // > 1 (a power of two, <= 16): each chunk has this many landmarks, chunk c's
  // at landmark rows c * landmarks_per_chunk + j (chunk_cap, landmark_cap and
  // shared_chunks still count chunks: the arrays hold that many times as many
  // rows), the means of the chunk's consecutive runs of keys
  // (ChunkLandmarksArgs::landmarks_per_chunk). Each row is scored as a chunk
  // is (the softmax runs over every row of the selectable chunks), and a
  // chunk's score is its best row's: a chunk holding one key that matches the
  // query scores as that key's run does, not as the mean of the whole chunk.
  // Selection and fetch stay per chunk.
  int landmarks_per_chunk = 1;
  float* scores = nullptr;    // [batch, hkv, score_stride] f32
  int64_t score_stride = 0;   // >= max_chunks
  void* workspace = nullptr;  // ShadowkvScoreWorkspaceBytes() bytes
  size_t workspace_bytes = 0;
  // Optional selection (Algorithm 2's top-k), select_k in [1, kTopKMaxK]: the
  // indices of each row's select_k best chunks, ascending, never an excluded
  // chunk, then -1 (topk.cuh with skip_worst_inf), at selection[row *
  // selection_stride ..]. `scores` is then scratch: where every row's chunks
  // fit in shared memory (max_chunks <= kTopKSharedKeys) the scores are
  // computed inside the selection kernel (the merge of the split statistics,
  // the group maximum and the top-k in one launch) and `scores` is not written.
  int select_k = 0;
  int32_t* selection = nullptr;
  int64_t selection_stride = 0;  // >= select_k
  // With a selection: the score of each selected chunk,
  // selection_scores[row * selection_stride + i] for i < selection_stride
  // (-inf where the selection is -1 and for i >= select_k); null: not written.
  float* selection_scores = nullptr;

  // ---- context parallel: scores normalized over every shard (global top-k,
  // docs/architecture.md "Context parallel"), two calls around an exchange of
  // each query head's softmax statistics.
  // stats_out != null: the first call. Writes each (sequence b, query head g)'s
  // (max, sum exp) of the scaled logits over its selectable chunks to
  // stats_out[(b * hq + g) * 2 + {0, 1}] ((-inf, 0) when there are none) and
  // nothing else (no scores, no selection).
  float* stats_out = nullptr;
  // stats_in != null: the second call. The softmax of every head uses the
  // combination over p < stats_parts of the statistics stats_in + p *
  // stats_part_stride (floats), same layout: m = max m_p, s = sum s_p exp(m_p - m)
  // (parts with m_p = -inf ignored). Its other arguments equal the first
  // call's; on the GPU it reuses the first call's logits (the same workspace:
  // workspace_part, below), on the CPU it recomputes them.
  const float* stats_in = nullptr;
  int stats_parts = 0;
  int64_t stats_part_stride = 0;
  // Which of the CUDA backend's score workspaces the call uses (calls that
  // are in flight together, e.g. a first call's logits kept for its second
  // call while other groups score, name different parts). CPU: ignored.
  int workspace_part = 0;
  // The caller's promise that every batch entry is attached to one prefix:
  // shared_landmarks[b] is the same array for every b, each n_chunks[b] >=
  // shared_chunks, and the excluded marks of chunks below shared_chunks are
  // the same for every b (the prefix's). The GPU then scores the prefix's
  // chunks for every entry in one pass (shadowkv_shared_scores.cu: its
  // landmarks read once per 128 query heads instead of once per entry) when
  // the call selects (select_k > 0), is not one of context parallel's two
  // calls, has no successors, and the shape is the tensor-core path's (bf16 q,
  // d 64 or 128, bf16 or fp8 landmarks, hq / hkv a power of two up to 8); the
  // scores and selection are the same quantities. CPU: ignored.
  bool one_prefix = false;
};
// Workspace bytes for any call of this size (an upper bound of the next).
size_t ShadowkvScoreWorkspaceBytes(int batch, int hq, int max_chunks, int landmarks_per_chunk = 1);
// Workspace bytes for this call: a one-prefix call (one_prefix, taken by the
// GPU's shared scores) needs its scores and statistics, ~1/landmarks_per_chunk
// of the others' logits (136 MB rather than 514 at 64 x 124928, 4 rows a
// chunk). Needs the call's q_dtype and dtype.
size_t ShadowkvScoreWorkspaceBytes(const ShadowkvScoreArgs& args);

// The element-wise maximum over rows: out[c] = max(out[c] when accumulate,
// in[r * row_stride + c] for r in [0, rows)), c in [0, cols). A sparse
// continuation's selection scores (the maximum of several query rows'
// ShadowkvScore scores per chunk).
struct MaxRowsArgs {
  const float* in = nullptr;
  int rows = 0;
  int64_t row_stride = 0;  // >= cols
  int64_t cols = 0;
  float* out = nullptr;  // [cols]
  bool accumulate = false;
};

// ---- 1b. chunk scores of many queries over one sequence ----------------------
// A sparse continuation's selection: every query row of a prefill piece
// scored against the landmarks of the one sequence the piece continues, in a
// pass that reads each landmark row once per 128 query heads (ShadowkvScore
// with one batch entry per query row reads them once per row).
//   best[c] = max over the query rows i, the query heads g and chunk c's
//             landmark rows v of softmax_v'(q[i][g] . L[h(g)][v'] * scale)[v],
// the softmax over the selectable landmark rows of g's KV head h(g) (as
// ShadowkvScore's, whose per-row scores' maximum over rows and KV heads this
// is). A chunk excluded for a head counts for no query head of it; a chunk
// excluded for every head, and c in [n_chunks, max_chunks), get -inf.
// `score` describes the sequence as a ShadowkvScore call with batch 1 would
// (landmarks, shared_landmarks, excluded, n_chunks device arrays of one
// entry; shape, landmark format, scale); its q is [rows][hq][d]. Its
// scores, selection, successors and statistics fields are not used.
// The tensor-core path: bf16 q, d 64 or 128, bf16 or fp8 landmarks;
// LaunchShadowkvQueryScores returns false for other shapes (the caller scores
// row by row with ShadowkvScore and takes MaxRows).
struct ShadowkvQueryScoresArgs {
  ShadowkvScoreArgs score;
  int rows = 0;               // query rows (tokens) of q
  float* best = nullptr;      // [score.max_chunks] f32
  void* workspace = nullptr;  // ShadowkvQueryScoresWorkspaceBytes() bytes
  size_t workspace_bytes = 0;
};
size_t ShadowkvQueryScoresWorkspaceBytes(int rows, int hq, int hkv, int max_chunks, int landmarks_per_chunk);

// ---- 2b. global selection (context parallel) ---------------------------------
// The shards of a sequence (one per rank of a group) each proposed their best
// chunks per KV head: a ShadowkvScore selection (scores normalized over every
// shard: stats_in) with its selection_scores, all-gathered. Part p's proposal
// scores are at candidates + p * part_stride, [row * cand_stride + i] (-inf:
// none). Per row the k best of the parts * cand_stride proposals (ties to the
// lower part, then the lower i; -inf never) are the sequence's selection; this
// rank (part `rank`) keeps its own winners:
//   selection[row * selection_stride + j], j < selection_len: the chunk ids
//   proposals[row * cand_stride + i] of the winning i of part `rank`,
//   ascending, then -1.
// Every rank computes the same winners from the same candidates, so the
// shards agree on one top-k. winners: scratch, [rows][k] int32.
// Supported: 1 <= k <= kTopKMaxK; parts * cand_stride <= 2^31 - 1.
struct ShadowkvGlobalSelectArgs {
  const float* candidates = nullptr;  // [parts][part_stride] f32
  int parts = 0, rank = 0;
  int64_t part_stride = 0;             // >= rows * cand_stride
  int rows = 0;                        // batch * hkv
  int cand_stride = 0;                 // proposals per row and part
  int k = 0;                           // the whole sequence's budget in chunks
  const int32_t* proposals = nullptr;  // this rank's chunk ids, [rows][cand_stride] (-1: none)
  int32_t* winners = nullptr;          // scratch [rows][k]
  int32_t* selection = nullptr;        // [rows][selection_stride]; must not alias proposals
  int64_t selection_stride = 0;
  int selection_len = 0;  // <= selection_stride; >= this rank's proposals per row
};

// ---- 3. slot update (hit cache) ---------------------------------------------
// Per row: the new selection (selection[row][0..kslots), chunk ids, -1 =
// none; at most kslots valid) against the slot map. Chunks already in a slot
// (hits) keep their slot. Every selected chunk not present (miss) takes a slot
// whose chunk is not selected, lowest slot first, misses in selection order;
// slots left over become -1. Afterwards the slot map holds exactly the
// selection. Outputs per row: miss_count, and miss_slot / miss_chunk
// [row][0..miss_count) (entries up to kslots set to -1).
// force_keep in [0, 1] (< 0 disables) first replaces the selection with:
// the chunks of the round(force_keep * kslots) lowest valid slots of the
// previous map (fewer if fewer are valid), then selected chunks that are not
// in the previous map, in selection order, then selected chunks of the
// previous map not yet kept, until kslots chunks (emulates a hit rate).
// Requires chunk ids < chunk_cap; shared memory is chunk_cap / 4 bytes.
struct ShadowkvSlotUpdateArgs {
  const int32_t* selection = nullptr;   // [batch * hkv, selection_stride] (LaunchTopK output)
  int64_t selection_stride = 0;         // >= kslots
  int32_t* const* slot_maps = nullptr;  // device [batch] -> [hkv][kslots], updated in place
  int32_t* miss_count = nullptr;        // [batch * hkv]
  int32_t* miss_slot = nullptr;         // [batch * hkv][kslots]
  int32_t* miss_chunk = nullptr;        // [batch * hkv][kslots]
  int batch = 0, hkv = 0, kslots = 0, chunk_cap = 0;
  float force_keep = -1.0f;
};

// ---- 4. key rebuild for misses ----------------------------------------------
// For each miss (row, slot, chunk) and i < chunk_size, token t = chunk *
// chunk_size + i: k = A[t] . B[h] (f32 accumulate), rotate-half RoPE at
// position t + position_offset[b] (angle = float(pos) * inv_freq[j] in f32,
// pairs (j, j + d/2)), written to K row outlier_rows + slot * chunk_size + i
// of head h. Miss lists are ShadowkvSlotUpdate's outputs.
// Supported: d even, d <= 512; r <= kShadowkvMaxRebuildRank; chunk_size 1..64.
inline constexpr int kShadowkvMaxRebuildRank = 512;
enum class RebuildKAlgo : uint8_t {
  kAuto,  // tensor cores when dtype is bf16, d % 64 == 0 and it fits in shared memory
  kMma,   // tensor-core path (falls back to kSimt where unsupported)
  kSimt,  // f32 FMA path
};
struct ShadowkvRebuildKArgs {
  // Token t's A row: shared_a[b] + t*r for t < shared_chunks*C (an attached
  // prefix's), else a[b] + (t - shared_chunks*C)*r.
  const void* const* a = nullptr;         // device [batch] -> A [token_cap][r]
  const void* const* shared_a = nullptr;  // device [batch]; may be null when shared_chunks == 0
  int shared_chunks = 0;
  const void* const* b = nullptr;            // device [batch] -> B [hkv][r][d]
  const int32_t* position_offset = nullptr;  // device [batch]; null = 0
  const float* inv_freq = nullptr;           // device [d/2]
  const int32_t* miss_count = nullptr;       // [batch * hkv]
  const int32_t* miss_slot = nullptr;        // [batch * hkv][miss_stride]
  const int32_t* miss_chunk = nullptr;       // [batch * hkv][miss_stride]
  int miss_stride = 0;                       // kslots
  void* const* att_k = nullptr;              // device [batch] -> K [hkv][att_cap][d]
  int64_t att_head_stride = 0;               // att_cap * d
  int outlier_rows = 0;                      // O * chunk_size: row of slot 0
  DType dtype = DType::kBF16;                // A, B and K: bf16 or f32
  int batch = 0, hkv = 0, d = 0, r = 0, chunk_size = 0;
  int max_misses = 0;  // host-side bound of miss_count (sizes the grid)
  RebuildKAlgo algo = RebuildKAlgo::kAuto;
};

// ---- 5./6. value fetch for misses -------------------------------------------
// For each miss (row, slot, chunk): copies the chunk's C*d values to V rows
// outlier_rows + slot * chunk_size .. + chunk_size of head h.
//  FetchV (staging == null): source value_store[b] + (h * chunk_cap + chunk) *
//    C*d (or the shared store's row, below), a device-accessible pointer to
//    mapped pinned host memory (zero copy).
//  ScatterV (staging != null): the chunks were already gathered into the
//    device buffer `staging` in miss-list order: miss m of row x is at chunk
//    index staging_offsets[x] + m (staging_offsets null: x * miss_stride).
// Requires C*d*sizeof(dtype) % 16 == 0 and 16-byte aligned bases.
struct ShadowkvFetchVArgs {
  // Chunks below shared_chunks come from shared_store[b] (a prefix's values,
  // [hkv][shared_stride][C*d], held by every sequence attached to it); chunk
  // c >= shared_chunks from value_store[b] as row c - shared_chunks.
  const void* const* value_store = nullptr;  // device [batch] -> [hkv][chunk_cap][C*d]
  int chunk_cap = 0;
  const void* const* shared_store = nullptr;  // device [batch]; may be null when shared_chunks == 0
  int shared_chunks = 0;
  int shared_stride = 0;                     // rows from one head's shared values to the next's (>= shared_chunks)
  const void* staging = nullptr;             // ScatterV only
  const int32_t* staging_offsets = nullptr;  // ScatterV only, device [batch * hkv]
  const int32_t* miss_count = nullptr;
  const int32_t* miss_slot = nullptr;
  const int32_t* miss_chunk = nullptr;
  int miss_stride = 0;
  void* const* att_v = nullptr;  // device [batch] -> V [hkv][att_cap][d]
  int64_t att_head_stride = 0;
  int outlier_rows = 0;
  DType dtype = DType::kBF16;  // bf16 or f32 (store, staging and V alike; V's only with values_fp8)
  // The store's and staging's rows are fp8 (kernels/value_format.h:
  // ValueRowBytesFp8 bytes a row), dequantized into V; needs d % 16 == 0.
  bool values_fp8 = false;
  int batch = 0, hkv = 0, d = 0, chunk_size = 0;
  int max_misses = 0;
  int max_blocks = 0;  // blocks the fetch may use (0: the default, 32)
  // The rows read are mostly in device memory (an attached document's values
  // in tier 0): bf16/f32 rows are copied a warp per missed chunk (the miss
  // looked up once), not a thread per 16 bytes sized for the host link.
  // Any address still works; only the speed differs.
  bool values_on_device = false;
  // Chunks below shared_chunks are not copied: the attention reads them in
  // place (DecodeAttentionArgs::slot_values). With values_on_device, not
  // with values_fp8 or staging.
  bool skip_shared = false;
};

// The selection of `a` as a top-k over a.scores (the unfused path, and the
// CPU backend's selection).
inline TopKArgs ShadowkvSelectionTopK(const ShadowkvScoreArgs& a) {
  TopKArgs t;
  t.values = a.scores;
  t.stride = a.score_stride;
  t.rows = a.batch * a.hkv;
  t.counts = a.n_chunks;
  t.rows_per_count = a.hkv;
  t.max_count = a.max_chunks;
  t.k = a.select_k;
  t.skip_worst_inf = true;
  t.out = a.selection;
  t.out_stride = a.selection_stride;
  return t;
}

}  // namespace penumbra::kernels
