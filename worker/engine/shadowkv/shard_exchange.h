// What the ranks of a context-parallel group send each other in a ShadowKV
// decode step under the global selection (ShadowKvOptions::shard_selection
// "global"; docs/architecture.md, "Context parallel"). Per layer:
//   1. per sequence, each query head's softmax statistics (max, sum) over
//      this shard's chunks: all-gathered, so every shard normalizes its
//      scores over the whole sequence;
//   2. per sequence and KV head, the scores of this shard's proposals (its
//      own top-k chunks under that normalization): all-gathered, so every
//      rank computes the same global top-k of all proposals and keeps its
//      own winners.
// Owns the device buffer carved into those send/receive rows plus the
// proposals' chunk ids, the global top-k's winners and this rank's
// selection. Needs the backend (allocation, initialization) and, per step,
// the group (Collective) and the step's sequences; the policy launches the
// kernels (ShadowkvScore, ShadowkvGlobalSelectAndSlotUpdate) and calls
// AllGatherStats / AllGatherCandidates between them. SpeContext's global
// selection (one per step, over the retrieval head's one-token "chunks")
// uses the same exchange through the shape-only Prepare.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "worker/engine/collective.h"
#include "worker/engine/shadowkv/layout.h"

namespace penumbra {

class ShadowKvShardExchange {
 public:
  ShadowKvShardExchange(const PolicyContext& ctx, Backend& backend) : ctx_(ctx), backend_(backend) {}

  // The group of a step's sequences: the one any of them exchanges through
  // (null: none, the step selects per shard).
  static Collective* GroupOf(const std::vector<ShadowKvSeq*>& seqs);

  // The step's exchange buffers for `group` (rows a sparse group never
  // writes, a shard too short to be sparse, hold "no statistics" and "no
  // proposal" for the whole step). Internal when the step mixes the
  // group's shards with sequences of their own selection.
  Status Prepare(Collective* group, const std::vector<ShadowKvSeq*>& seqs);
  // The same for `batch` sequences of `hq` query heads over ctx.hkv KV
  // heads, each proposing `width` chunks per KV head.
  Status Prepare(Collective* group, int batch, int hq, int width);

  Collective* group() const { return group_; }
  int width() const { return xk_; }        // proposals per KV head row (the largest global_k)
  size_t stats() const { return stats_; }  // floats of statistics one rank sends
  size_t cand() const { return cand_; }    // floats of proposal scores one rank sends

  // The rows, per sequence i of the step: stats at i * hq * 2, proposals
  // (and their scores, winners, selection) at i * hkv * width().
  float* stats_send() const { return stats_send_; }
  float* stats_recv() const { return stats_recv_; }  // world() blocks of stats()
  float* cand_send() const { return cand_send_; }
  float* cand_recv() const { return cand_recv_; }  // world() blocks of cand()
  int32_t* proposals() const { return proposals_; }
  int32_t* winners() const { return winners_; }
  int32_t* selection() const { return selection_; }

  // The all-gathers of steps 1 and 2.
  Status AllGatherStats() { return group_->AllGather(stats_send_, stats_recv_, stats_ * sizeof(float)); }
  Status AllGatherCandidates() { return group_->AllGather(cand_send_, cand_recv_, cand_ * sizeof(float)); }

 private:
  const PolicyContext& ctx_;
  Backend& backend_;
  Collective* group_ = nullptr;
  DeviceBuffer buf_;
  int xk_ = 0;
  size_t stats_ = 0, cand_ = 0;
  float *stats_send_ = nullptr, *stats_recv_ = nullptr, *cand_send_ = nullptr, *cand_recv_ = nullptr;
  int32_t *proposals_ = nullptr, *winners_ = nullptr, *selection_ = nullptr;
};

}  // namespace penumbra
