#include "worker/engine/shadowkv_options.h"

#include "kernels/shadowkv_decode_args.h"

namespace penumbra {

namespace {

std::string PowerOfTwoDividingChunk(const ShadowKvOptions& o) {
  const int lpc = o.landmarks_per_chunk;
  if ((lpc & (lpc - 1)) != 0 || (o.chunk_size >= 1 && o.chunk_size % lpc != 0)) {
    return "must be a power of two up to 16 dividing chunk_size (" + std::to_string(o.chunk_size) + "), got " +
           std::to_string(lpc);
  }
  return "";
}

}  // namespace

const OptionTable<ShadowKvOptions>& ShadowKvOptionTable() {
  using O = ShadowKvOptions;
  static const auto* table =
      &(*new OptionTable<O>("shadowkv"))
           .Int(&O::rank, "rank", "rank", 1, 1 << 16,
                "rank of the pre-RoPE key factors (at most hkv x head_dim; 512 on CUDA)")
           .Int(&O::chunk_size, "chunk-size", "chunk_size", 1, 1024, "tokens per chunk (64 at most on CUDA)")
           .Int(&O::budget_tokens, "budget", "budget_tokens", int64_t{1}, int64_t{1} << 32,
                "sparse budget in tokens per KV head, a multiple of chunk_size")
           .Double(&O::budget_fraction, "budget-fraction", "budget_fraction", 0.0, 1.0,
                   "sparse budget as a fraction of the context; > 0 overrides the budget")
           .Int(&O::outlier_chunks, "outliers", "outlier_chunks", 0, 1 << 20, "outlier chunks per KV head")
           .Double(&O::outlier_fraction, "outlier-fraction", "outlier_fraction", 0.0, 1.0,
                   "outliers as a fraction of the prompt's chunks, below 1; > 0 overrides the outliers")
           .Int(&O::local_window, "local-window", "local_window", 1, 1 << 20, "recent tokens kept exact")
           .Int(&O::min_prompt_tokens, "min-prompt", "min_prompt_tokens", int64_t{0}, int64_t{1} << 40,
                "prompts shorter than this use full attention")
           .Enum(&O::value_fetch, "value-fetch", "value_fetch", {"zero_copy", "staging"},
                 "how decode reads values from host memory")
           .Double(&O::force_hit_rate, "", "force_hit_rate", -1.0, 1.0,
                   "benchmarks only: keep this fraction of the previous step's chunks (< 0: off)")
           .Int(&O::micro_batches, "micro-batches", "micro_batches", 1, 16,
                "pipeline each decode batch as this many micro-batches")
           .Bool(&O::fetch_turns, "", "fetch_turns", "lanes take turns on the host link for their value fetches")
           .Int(&O::fetch_blocks, "fetch-blocks", "fetch_blocks", 1, 1024, "thread blocks of the zero-copy value fetch")
           .Enum(&O::continuation, "continuation", "continuation", {"auto", "dense", "sparse"},
                 "how a prefill after a factored prompt attends to it (auto: sparse up to "
                 "continuation_auto_max_tokens, dense beyond)")
           .Int(&O::continuation_budget_tokens, "continuation-budget", "continuation_budget_tokens", int64_t{0},
                int64_t{1} << 32, "tokens a sparse continuation selects per KV head (0: the budget)")
           .Int(&O::continuation_auto_max_tokens, "continuation-auto-max", "continuation_auto_max_tokens", int64_t{0},
                int64_t{1} << 31, "auto: the longest continuation (tokens) that is sparse")
           .Enum(&O::shard_selection, "shard-selection", "shard_selection", {"global", "local"},
                 "context parallel: one top-k over every shard, or each shard its share")
           .Int(&O::successor_chunks, "successor-chunks", "successor_chunks", 0, 64,
                "a chunk scores as high as its best of this many predecessors")
           .Int(&O::landmarks_per_chunk, "landmarks-per-chunk", "landmarks_per_chunk", 1, 16,
                "landmarks per chunk, a chunk scoring as its best (1: the paper's)")
           .Enum(&O::landmark_format, "landmark-format", "landmark_format", {"fp8", "model"},
                 "how landmarks are stored: fp8 (e4m3, a scale per chunk) or the model's dtype")
           .Enum(&O::value_format, "value-format", "value_format", {"bf16", "fp8"},
                 "how offloaded values are stored: bf16 (the model's dtype) or fp8 (e4m3, a scale per token)")
           .Check("outlier_fraction",
                  [](const O& o) -> std::string {
                    return o.outlier_fraction < 1 ? "" : "must be below 1, got " + std::to_string(o.outlier_fraction);
                  })
           .Check("budget_tokens",
                  [](const O& o) -> std::string {
                    if (o.budget_fraction > 0 || o.budget_tokens % o.chunk_size == 0) return "";
                    return "(" + std::to_string(o.budget_tokens) + ") must be a multiple of chunk_size (" +
                           std::to_string(o.chunk_size) + ")";
                  })
           .Check("continuation_budget_tokens",
                  [](const O& o) -> std::string {
                    if (o.continuation_budget_tokens % o.chunk_size == 0 &&
                        o.continuation_budget_tokens / o.chunk_size <= 4096) {
                      return "";
                    }
                    return "(" + std::to_string(o.continuation_budget_tokens) +
                           ") must be 0 or a multiple of chunk_size of at most 4096 chunks";
                  })
           .Check("landmarks_per_chunk", PowerOfTwoDividingChunk);
  return *table;
}

void AddShadowKvFlags(Args& a) { ShadowKvOptionTable().AddFlags(a); }

Status ApplyShadowKvFlags(const Args& a, ShadowKvOptions* o) { return ShadowKvOptionTable().ApplyFlags(a, o); }

Status LoadShadowKvOptions(ConfigReader& r, ShadowKvOptions* o) { return ShadowKvOptionTable().Load(r, o); }

Status ValidateShadowKvOptions(const ShadowKvOptions& o, int hkv, int head_dim) {
  PENUMBRA_RETURN_IF_ERROR(ShadowKvOptionTable().Validate(o));
  const int full_rank = hkv * head_dim;
  if (o.rank > full_rank) {
    return Status::InvalidArgument("shadowkv.rank (--rank) must be at most hkv x head_dim = " +
                                   std::to_string(full_rank) + " for this model, got " + std::to_string(o.rank));
  }
  return Status::OK();
}

Status ValidateShadowKvOnDevice(const ShadowKvOptions& o, int hq, int hkv, int head_dim, Device device) {
  static_assert(kShadowKvMaxSelectedChunks == kernels::kTopKMaxK, "the selection's limit is the GPU top-k's");
  if (o.budget_fraction <= 0 && o.chunk_size >= 1 && o.budget_tokens / o.chunk_size > kShadowKvMaxSelectedChunks) {
    return Status::InvalidArgument("shadowkv.budget_tokens " + std::to_string(o.budget_tokens) + " is " +
                                   std::to_string(o.budget_tokens / o.chunk_size) +
                                   " chunks; a selection takes at most " + std::to_string(kShadowKvMaxSelectedChunks) +
                                   " per KV head");
  }
  if (device != Device::kCUDA) return Status::OK();
  if (o.value_fp8() && head_dim % 16 != 0) {
    return Status::InvalidArgument("shadowkv.value_format fp8 on CUDA needs head_dim a multiple of 16; the model has " +
                                   std::to_string(head_dim));
  }
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
