#include "worker/engine/shadowkv/shard_exchange.h"

#include <algorithm>
#include <limits>

namespace penumbra {

Collective* ShadowKvShardExchange::GroupOf(const std::vector<ShadowKvSeq*>& seqs) {
  Collective* group = nullptr;
  for (const ShadowKvSeq* s : seqs) group = s->group != nullptr ? s->group : group;
  return group;
}

Status ShadowKvShardExchange::Prepare(Collective* group, const std::vector<ShadowKvSeq*>& seqs) {
  int width = 0;
  for (const ShadowKvSeq* s : seqs) {
    // Beside the group's shards only dense sequences (too short to select
    // from), whose rows propose nothing.
    if (s->group != group && !(s->group == nullptr && !s->sparse)) {
      return Status::Internal("shadowkv: a decode step mixes shards of a context-parallel group with other sequences");
    }
    width = std::max(width, s->global_k);
  }
  return Prepare(group, static_cast<int>(seqs.size()), ctx_.hq, width);
}

Status ShadowKvShardExchange::Prepare(Collective* group, int batch, int hq, int width) {
  group_ = group;
  xk_ = width;
  const int B = batch, H = ctx_.hkv, W = group_->world();
  const size_t stats = static_cast<size_t>(B) * hq * 2, cand = static_cast<size_t>(B) * H * xk_;
  const size_t bytes = sizeof(float) * (stats * (1 + W) + cand * (1 + W)) + sizeof(int32_t) * 3 * cand;
  if (buf_.bytes() < bytes) {
    PENUMBRA_RETURN_IF_ERROR(backend_.Synchronize());
    PENUMBRA_ASSIGN_OR_RETURN(buf_, backend_.Allocate(bytes * 2));
  }
  stats_ = stats;
  cand_ = cand;
  stats_send_ = buf_.as<float>();
  stats_recv_ = stats_send_ + stats;
  cand_send_ = stats_recv_ + stats * W;
  cand_recv_ = cand_send_ + cand;
  proposals_ = reinterpret_cast<int32_t*>(cand_recv_ + cand * W);
  winners_ = proposals_ + cand;
  selection_ = winners_ + cand;
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  std::vector<float> init(stats);
  for (size_t i = 0; i < stats; i += 2) init[i] = kNone, init[i + 1] = 0.0f;
  PENUMBRA_RETURN_IF_ERROR(backend_.CopyToDevice(stats_send_, init.data(), stats * sizeof(float)));
  init.assign(cand, kNone);
  return backend_.CopyToDevice(cand_send_, init.data(), cand * sizeof(float));
}

}  // namespace penumbra
