#include "worker/engine/shadowkv_options.h"

namespace penumbra {

Status LoadShadowKvOptions(ConfigReader& r, ShadowKvOptions* o) {
  r.Read("rank", &o->rank, 1, 1 << 16);
  r.Read("chunk_size", &o->chunk_size, 1, 1024);
  r.Read("budget_tokens", &o->budget_tokens, 1, int64_t{1} << 32);
  r.Read("budget_fraction", &o->budget_fraction, 0.0, 1.0);
  r.Read("outlier_chunks", &o->outlier_chunks, 0, 1 << 20);
  r.Read("outlier_fraction", &o->outlier_fraction, 0.0, 0.999);
  r.Read("local_window", &o->local_window, 1, 1 << 20);
  r.Read("min_prompt_tokens", &o->min_prompt_tokens, 0, int64_t{1} << 40);
  r.ReadEnum("value_fetch", &o->value_fetch, {"zero_copy", "staging"});
  r.Read("force_hit_rate", &o->force_hit_rate, -1.0, 1.0);
  r.Read("micro_batches", &o->micro_batches, 1, 16);
  r.Read("fetch_turns", &o->fetch_turns);
  return r.Finish();
}

Status ValidateShadowKvOptions(const ShadowKvOptions& o, int hkv, int head_dim) {
  const int full_rank = hkv * head_dim;
  if (o.rank < 1 || o.rank > full_rank) {
    return Status::InvalidArgument("shadowkv.rank must be in [1, hkv*head_dim = " + std::to_string(full_rank) +
                                   "], got " + std::to_string(o.rank));
  }
  if (o.chunk_size < 1) return Status::InvalidArgument("shadowkv.chunk_size must be >= 1");
  if (o.budget_fraction <= 0 && (o.budget_tokens < o.chunk_size || o.budget_tokens % o.chunk_size != 0)) {
    return Status::InvalidArgument("shadowkv.budget_tokens (" + std::to_string(o.budget_tokens) +
                                   ") must be a positive multiple of chunk_size (" + std::to_string(o.chunk_size) + ")");
  }
  if (o.outlier_chunks < 0) return Status::InvalidArgument("shadowkv.outlier_chunks must be >= 0");
  if (o.outlier_fraction < 0 || o.outlier_fraction >= 1) {
    return Status::InvalidArgument("shadowkv.outlier_fraction must be in [0, 1)");
  }
  if (o.local_window < 1) return Status::InvalidArgument("shadowkv.local_window must be >= 1");
  if (o.value_fetch != "zero_copy" && o.value_fetch != "staging") {
    return Status::InvalidArgument("shadowkv.value_fetch must be zero_copy or staging, got '" + o.value_fetch + "'");
  }
  if (o.force_hit_rate > 1.0) return Status::InvalidArgument("shadowkv.force_hit_rate must be <= 1");
  if (o.micro_batches < 1 || o.micro_batches > 16) {
    return Status::InvalidArgument("shadowkv.micro_batches must be in [1, 16], got " + std::to_string(o.micro_batches));
  }
  return Status::OK();
}

}  // namespace penumbra
