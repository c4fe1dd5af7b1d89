// One ShadowKV decode step's tables and the selector's arguments.
//
// Begin (once per step, from the policy's BeginDecodeStep) groups the step's
// sequences into runs of equal geometry (and micro-batches), uploads one
// blob holding, per layer, the pointer tables the kernels read (Table below:
// kTables entries per sequence) and, after them, per sequence the ints
// (Int below: attention length, chunk count, first position), and sizes the
// selection workspaces (miss lists, score rows). The *Of methods then give
// the kernel arguments of a group of sequences at a layer: RoPE+store,
// Algorithm 2's scores and top-k (the selector, with the decode budget
// s.kslots), the slot update, the value fetch (V), the key rebuild
// (K = A*B + RoPE) and attention. They only describe; the caller launches
// them (the policy on its streams, the independent check one by one).
//
// Owns: the step's device blob (tables + ints) and workspaces; the list of
// the step's sequences (not owned: they must outlive the step). Needs: the
// layout (geometry and options), the backend (allocations, upload).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/shadowkv_decode_args.h"
#include "worker/engine/shadowkv/layout.h"

namespace penumbra {

class ShadowKvDecodeStep {
 public:
  // The pointer table entries of one sequence at one layer (each a row of
  // `batch` pointers in the step's table of that layer).
  enum Table : int {
    kNewK = 0,  // the new token's K row (RopeStore's destination)
    kNewV = 1,  // ... and V row
    kAttK = 2,  // attention rows, head 0, row 0 (outliers | slots | local)
    kAttV = 3,
    kLandmarks = 4,      // the sequence's own landmark records
    kExcluded = 5,       // outlier marks [hkv][chunk_cap]
    kSlots = 6,          // slot maps [hkv][kslots]
    kA = 7,              // A rows (own chunks)
    kB = 8,              // B factor
    kValues = 9,         // the value store's layer (device address of pinned host memory)
    kNewPreK = 10,       // the new token's pre-RoPE key row
    kSharedValues = 11,  // an attached prefix's values (null: none, or still read from disk)
    kSharedLandmarks = 12,
    kSharedA = 13,
    kTables = 14,
  };
  // The per-sequence ints after the tables (each a row of `batch`).
  enum Int : int {
    kLength = 0,     // attention length (a closed shard's new row not attended)
    kChunks = 1,     // chunk count
    kPosition0 = 2,  // first position (a shard's; the rebuilt keys' RoPE offset)
    kInts = 3,
  };

  ShadowKvDecodeStep(const ShadowKvLayout& layout, Backend& backend) : lay_(layout), backend_(backend) {}

  // Starts a step over `seqs` (every pointer valid until the next Begin):
  // groups, the uploaded tables and ints, the workspaces.
  Status Begin(const std::vector<ShadowKvSeq*>& seqs);

  // ---- the step
  int batch() const { return batch_; }
  ShadowKvSeq& seq(int i) const { return *seqs_[static_cast<size_t>(i)]; }
  const std::vector<ShadowKvSeq*>& seqs() const { return seqs_; }
  // Runs [first, first + count) of sequences sharing launches.
  const std::vector<std::pair<int, int>>& groups() const { return groups_; }
  int max_k() const { return max_k_; }                // the largest selection (0: no sparse sequence)
  bool position_offsets() const { return offsets_; }  // a sequence is a shard after position 0

  // ---- its device tables
  void* const* Tables(int layer) const;  // the table of `layer`: entry e of sequence i at [e * batch + i]
  const int32_t* Ints() const;           // int n of sequence i at [n * batch + i]
  // The miss lists of a group (step rows, stride kslots) and the per-layer
  // miss counts (for the hit rate: MissCountsAll holds every layer's).
  int32_t* MissSlots(int g0) const;
  int32_t* MissChunks(int g0) const;
  int32_t* MissCounts(int layer, int g0) const;
  const int32_t* MissCountsAll() const;

  // ---- the kernels' arguments for group [g0, g0 + gn) at `layer`
  // RoPE of the new tokens, their K/V into the attention rows (queries to
  // q_scratch's rows of the group).
  RopeStoreOp RopeStoreOf(int layer, int g0, int gn, const float* qkv, const int32_t* positions, void* q_scratch) const;
  // Attention over the rows. mask_slots: empty slots' rows are not attended. values_in_place (implies
  // mask_slots): slots holding the attached prefix's chunks read their V rows
  // from the prefix's values (in device memory), not from the attention rows
  // (DecodeAttentionOp::slot_values).
  DecodeAttentionOp AttentionOf(int layer, int g0, int gn, const void* q, void* out, float* lse, bool mask_slots,
                                bool values_in_place = false) const;
  // Chunk scores (Algorithm 2), selecting s.kslots chunks into the step's
  // selection rows (the front of the miss workspace, stride kslots).
  kernels::ShadowkvScoreArgs ScoreArgsOf(int layer, int g0, int gn, const void* q) const;
  // The slot update of `selection` (stride `stride`) into the miss lists.
  kernels::ShadowkvSlotUpdateArgs SlotUpdateOf(int layer, int g0, int gn, const int32_t* selection,
                                               int64_t stride) const;
  // The misses' values from the store (zero copy; the policy adds the
  // staging fields and block count where they apply) and their keys.
  kernels::ShadowkvFetchVArgs FetchVOf(int layer, int g0, int gn) const;
  kernels::ShadowkvRebuildKArgs RebuildKOf(int layer, int g0, int gn) const;

 private:
  const ShadowKvLayout& lay_;
  Backend& backend_;
  std::vector<ShadowKvSeq*> seqs_;
  std::vector<std::pair<int, int>> groups_;
  DeviceBuffer step_buf_, miss_buf_, score_buf_;
  int batch_ = 0, max_k_ = 0, max_chunks_ = 0;
  bool offsets_ = false;
};

}  // namespace penumbra
