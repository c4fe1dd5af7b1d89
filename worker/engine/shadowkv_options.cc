#include "worker/engine/shadowkv_options.h"

#include "kernels/shadowkv_decode.cuh"

namespace penumbra {

void AddShadowKvFlags(Args& a) {
  a.Flag("rank", "shadowkv: rank of the pre-RoPE key factors (default 160; at most 512 on CUDA)")
      .Flag("chunk-size", "shadowkv: tokens per chunk (default 8)")
      .Flag("budget", "shadowkv: sparse budget in tokens (default 2048)")
      .Flag("budget-fraction", "shadowkv: sparse budget as a fraction of the context (overrides --budget)")
      .Flag("outliers", "shadowkv: outlier chunks per KV head (default 48)")
      .Flag("outlier-fraction", "shadowkv: outliers as a fraction of the prompt's chunks (overrides --outliers; default 0 = off)")
      .Flag("local-window", "shadowkv: recent tokens kept exact (default 32)")
      .Flag("min-prompt", "shadowkv: prompts shorter than this use full attention (default 4096)")
      .Flag("value-fetch", "shadowkv: zero_copy (default) or staging")
      .Flag("micro-batches", "shadowkv: pipeline each decode batch as this many micro-batches (default 1)")
      .Flag("fetch-blocks", "shadowkv: thread blocks of the zero-copy value fetch (default 32)")
      .Flag("continuation", "shadowkv: a prefill after a factored prompt attends dense (default) or sparse")
      .Flag("continuation-budget", "shadowkv: tokens a sparse continuation selects per KV head (default 0 = --budget)")
      .Flag("shard-selection", "shadowkv: context parallel: one global top-k over the shards (default) or local")
      .Flag("successor-chunks", "shadowkv: a chunk scores as high as its best of this many predecessors (default 0)")
      .Flag("landmarks-per-chunk",
            "shadowkv: landmarks per chunk, a chunk scoring as its best (default 4; 1: the paper's)")
      .Flag("landmark-format", "shadowkv: how landmarks are stored: fp8 (default: e4m3 with a scale per chunk, "
                               "half the bytes of bf16) or model (the model's dtype)");
}

Status ApplyShadowKvFlags(const Args& a, ShadowKvOptions* o) {
  ShadowKvOptions& s = *o;
  PENUMBRA_ASSIGN_OR_RETURN(int64_t rank, a.GetInt("rank", s.rank));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t cs, a.GetInt("chunk-size", s.chunk_size));
  PENUMBRA_ASSIGN_OR_RETURN(s.budget_tokens, a.GetInt("budget", s.budget_tokens));
  PENUMBRA_ASSIGN_OR_RETURN(s.budget_fraction, a.GetDouble("budget-fraction", s.budget_fraction));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t outl, a.GetInt("outliers", s.outlier_chunks));
  PENUMBRA_ASSIGN_OR_RETURN(s.outlier_fraction, a.GetDouble("outlier-fraction", s.outlier_fraction));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t lw, a.GetInt("local-window", s.local_window));
  PENUMBRA_ASSIGN_OR_RETURN(s.min_prompt_tokens, a.GetInt("min-prompt", s.min_prompt_tokens));
  if (rank < 1 || cs < 1 || outl < 0 || lw < 1 || rank > (1 << 16) || cs > 1024 || outl > (1 << 20) || lw > (1 << 20)) {
    return Status::InvalidArgument("shadowkv flags out of range (rank >= 1, chunk-size in [1,1024], outliers >= 0, local-window >= 1)");
  }
  if (s.budget_fraction < 0 || s.budget_fraction > 1) return Status::InvalidArgument("--budget-fraction must be in [0, 1]");
  if (!(s.outlier_fraction >= 0 && s.outlier_fraction < 1)) return Status::InvalidArgument("--outlier-fraction must be in [0, 1)");
  s.rank = static_cast<int>(rank);
  s.chunk_size = static_cast<int>(cs);
  s.outlier_chunks = static_cast<int>(outl);
  s.local_window = static_cast<int>(lw);
  if (a.Has("value-fetch")) s.value_fetch = a.Get("value-fetch");
  PENUMBRA_ASSIGN_OR_RETURN(int64_t mb, a.GetInt("micro-batches", s.micro_batches));
  if (mb < 1 || mb > 16) return Status::InvalidArgument("--micro-batches must be in [1, 16]");
  s.micro_batches = static_cast<int>(mb);
  PENUMBRA_ASSIGN_OR_RETURN(int64_t fb, a.GetInt("fetch-blocks", s.fetch_blocks));
  if (fb < 1 || fb > 1024) return Status::InvalidArgument("--fetch-blocks must be in [1, 1024]");
  s.fetch_blocks = static_cast<int>(fb);
  if (a.Has("continuation")) s.continuation = a.Get("continuation");
  if (s.continuation != "dense" && s.continuation != "sparse") {
    return Status::InvalidArgument("--continuation must be dense or sparse, got '" + s.continuation + "'");
  }
  PENUMBRA_ASSIGN_OR_RETURN(s.continuation_budget_tokens,
                            a.GetInt("continuation-budget", s.continuation_budget_tokens));
  if (s.continuation_budget_tokens < 0 || s.continuation_budget_tokens > (int64_t{1} << 32)) {
    return Status::InvalidArgument("--continuation-budget must be in [0, 2^32]");
  }
  PENUMBRA_ASSIGN_OR_RETURN(int64_t succ, a.GetInt("successor-chunks", s.successor_chunks));
  if (succ < 0 || succ > 64) return Status::InvalidArgument("--successor-chunks must be in [0, 64]");
  s.successor_chunks = static_cast<int>(succ);
  PENUMBRA_ASSIGN_OR_RETURN(int64_t lpc, a.GetInt("landmarks-per-chunk", s.landmarks_per_chunk));
  if (lpc < 1 || lpc > 16 || (lpc & (lpc - 1)) != 0) {
    return Status::InvalidArgument("--landmarks-per-chunk must be 1, 2, 4, 8 or 16, got " + std::to_string(lpc));
  }
  s.landmarks_per_chunk = static_cast<int>(lpc);
  if (a.Has("landmark-format")) s.landmark_format = a.Get("landmark-format");
  if (s.landmark_format != "model" && s.landmark_format != "fp8") {
    return Status::InvalidArgument("--landmark-format must be model or fp8, got '" + s.landmark_format + "'");
  }
  if (a.Has("shard-selection")) s.shard_selection = a.Get("shard-selection");
  if (s.shard_selection != "global" && s.shard_selection != "local") {
    return Status::InvalidArgument("--shard-selection must be global or local, got '" + s.shard_selection + "'");
  }
  return Status::OK();
}

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
  r.Read("fetch_blocks", &o->fetch_blocks, 1, 1024);
  r.ReadEnum("continuation", &o->continuation, {"dense", "sparse"});
  r.Read("continuation_budget_tokens", &o->continuation_budget_tokens, 0, int64_t{1} << 32);
  r.ReadEnum("shard_selection", &o->shard_selection, {"global", "local"});
  r.Read("successor_chunks", &o->successor_chunks, 0, 64);
  r.Read("landmarks_per_chunk", &o->landmarks_per_chunk, 1, 16);
  r.ReadEnum("landmark_format", &o->landmark_format, {"model", "fp8"});
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
  if (o.fetch_blocks < 1 || o.fetch_blocks > 1024) {
    return Status::InvalidArgument("shadowkv.fetch_blocks must be in [1, 1024], got " + std::to_string(o.fetch_blocks));
  }
  if (o.continuation != "dense" && o.continuation != "sparse") {
    return Status::InvalidArgument("shadowkv.continuation must be dense or sparse, got '" + o.continuation + "'");
  }
  if (o.continuation_budget_tokens < 0 || o.continuation_budget_tokens % o.chunk_size != 0 ||
      o.continuation_budget_tokens / o.chunk_size > 4096) {
    return Status::InvalidArgument("shadowkv.continuation_budget_tokens (" +
                                   std::to_string(o.continuation_budget_tokens) +
                                   ") must be 0 or a multiple of chunk_size of at most 4096 chunks");
  }
  if (o.successor_chunks < 0 || o.successor_chunks > 64) {
    return Status::InvalidArgument("shadowkv.successor_chunks must be in [0, 64], got " +
                                   std::to_string(o.successor_chunks));
  }
  if (o.shard_selection != "global" && o.shard_selection != "local") {
    return Status::InvalidArgument("shadowkv.shard_selection must be global or local, got '" + o.shard_selection + "'");
  }
  if (o.landmark_format != "model" && o.landmark_format != "fp8") {
    return Status::InvalidArgument("shadowkv.landmark_format must be model or fp8, got '" + o.landmark_format + "'");
  }
  const int lpc = o.landmarks_per_chunk;
  if (lpc < 1 || lpc > 16 || (lpc & (lpc - 1)) != 0 || o.chunk_size % lpc != 0) {
    return Status::InvalidArgument("shadowkv.landmarks_per_chunk (--landmarks-per-chunk, default 4) must be a power "
                                   "of two up to 16 dividing chunk_size (" + std::to_string(o.chunk_size) + "), got " +
                                   std::to_string(lpc));
  }
  return Status::OK();
}

Status ValidateShadowKvOnDevice(const ShadowKvOptions& o, int hq, int hkv, int head_dim, Device device) {
  static_assert(kShadowKvMaxSelectedChunks == kernels::kTopKMaxK, "the selection's limit is the GPU top-k's");
  if (o.budget_fraction <= 0 && o.chunk_size >= 1 && o.budget_tokens / o.chunk_size > kShadowKvMaxSelectedChunks) {
    return Status::InvalidArgument("shadowkv.budget_tokens " + std::to_string(o.budget_tokens) + " is " +
                                   std::to_string(o.budget_tokens / o.chunk_size) + " chunks; a selection takes at most " +
                                   std::to_string(kShadowKvMaxSelectedChunks) + " per KV head");
  }
  if (device != Device::kCUDA) return Status::OK();
  if (o.rank > kernels::kShadowkvMaxRebuildRank) {
    return Status::InvalidArgument("shadowkv.rank " + std::to_string(o.rank) + " is above " +
                                   std::to_string(kernels::kShadowkvMaxRebuildRank) +
                                   ", the most the CUDA backend's key rebuild takes");
  }
  if (o.chunk_size > 64) {
    return Status::InvalidArgument("shadowkv.chunk_size " + std::to_string(o.chunk_size) +
                                   " is above 64, the most the CUDA backend's key rebuild takes");
  }
  if (head_dim % 8 != 0 || head_dim > 256) {
    return Status::InvalidArgument("shadowkv on CUDA needs head_dim a multiple of 8 up to 256; the model has " +
                                   std::to_string(head_dim));
  }
  if (hkv < 1 || hq % hkv != 0 || hq / hkv > 8) {
    return Status::InvalidArgument("shadowkv on CUDA takes at most 8 query heads per KV head; the model has " +
                                   std::to_string(hq) + " over " + std::to_string(hkv));
  }
  return Status::OK();
}

}  // namespace penumbra
