// Options of the ShadowKV KV policy (paper defaults). All are runtime options
// (YAML under `shadowkv:` and CLI flags); none is a compile-time limit.
#pragma once

#include <cstdint>
#include <string>

#include "common/args.h"
#include "common/config.h"
#include "common/dtype.h"
#include "common/option_table.h"
#include "common/status.h"

namespace penumbra {

struct ShadowKvOptions {
  int rank = 160;                // rank of the pre-RoPE key factors (<= hkv*d). Default: 160.
  int chunk_size = 8;            // tokens per chunk (landmark granularity). Default: 8.
  int64_t budget_tokens = 2048;  // selected tokens per KV head per step (multiple of chunk_size). Default: 2048.
  double budget_fraction =
      0.0;  // if > 0, budget = fraction * context, rounded up to a chunk; overrides budget_tokens. Default: 0.
  int outlier_chunks = 48;  // exact chunks kept per KV head (lowest min-cosine). Default: 48.
  double outlier_fraction =
      0.0;                // if > 0, outliers = ceil(fraction * prompt chunks); overrides outlier_chunks. Default: 0.
  int local_window = 32;  // most recent tokens always kept exact (at least). Default: 32.
  int64_t min_prompt_tokens = 4096;  // shorter prompts use full attention. Default: 4096.
  std::string value_fetch =
      "zero_copy";  // "zero_copy" (GPU reads pinned host memory) or "staging". Default: zero_copy.
  double force_hit_rate =
      -1.0;  // benchmarks only: keep this fraction of the previous step's chunks (< 0: off). Default: -1.
  // Decode: split each batch of same-geometry sequences into this many
  // micro-batches per layer; one micro-batch's value fetch (side stream)
  // overlaps the next one's scoring, selection and K rebuild and the previous
  // one's attention, while the GEMMs still run once for the whole batch.
  // 1 = off. Not yet measured on a GPU. Default: 1.
  int micro_batches = 1;
  // Engines with several lanes: lanes take turns on the host link for their
  // value fetches (worker/engine/fetch_turns.h) instead of fetching in phase.
  // Default: true.
  bool fetch_turns = true;
  // Thread blocks of the zero-copy value fetch kernel: more keep more PCIe
  // reads in flight but take SMs from the other lane's compute. On the H200,
  // 32 beat 16, 48 and 64 (bench/results/2026-11-21-h200-fetch-blocks.jsonl). Default: 32.
  int fetch_blocks = 32;
  // How a prefill that continues a factored prompt (a question after a cached
  // document, a later document) attends to what the sequence holds:
  // "dense": every chunk (low-rank K rebuilt, every value read back), exact
  // at full rank; "sparse": per layer and KV head, the chunks the new tokens'
  // queries select from the landmarks (as decode selects, the score's maximum
  // over the first prefill piece's rows), plus the outliers and the local
  // rows. Sparse reads only the selected values: a document restored from
  // disk answers before its values are read back (docs/architecture.md,
  // "Prefix reuse"). "auto": sparse for a continuation of at most
  // continuation_auto_max_tokens tokens (a question, a turn: there its
  // accuracy was measured equal to dense's), dense for a longer one (a
  // later document). Default: auto.
  std::string continuation = "auto";
  // Chunks a sparse continuation selects per KV head, in tokens (multiple of
  // chunk_size); 0: the decode budget. Default: 0.
  int64_t continuation_budget_tokens = 0;
  // "auto": the longest continuation (its first prefill piece, in tokens)
  // that is sparse. Default: 1024.
  int64_t continuation_auto_max_tokens = 1024;
  // Context parallel (a sequence split into shards over a group of ranks):
  // "global": every decode step the shards agree on one top-k of the whole
  // sequence's budget (scores normalized over every shard, each shard's best
  // chunks exchanged; two small all-gathers per layer), as one GPU would
  // select; "local": each shard selects its share of the budget (split by
  // shard length) from its own chunks, no exchange. Default: global.
  std::string shard_selection = "global";
  // Decode's selection: a chunk also scores as high as its best of this many
  // chunks before it, so a selected chunk brings the chunks that follow it
  // (an answer copying a run of text, a UUID, a number, a line of code, needs
  // the run's continuation, which its own landmark may not point to). The
  // budget is unchanged. 0 = the paper's selection. Default: 0.
  int successor_chunks = 0;
  // Landmarks per chunk: keeps this many landmarks for each chunk, the means
  // of its consecutive runs of chunk_size / landmarks_per_chunk keys, and a
  // chunk scores as its best landmark. 1 is the paper's landmark, the mean of
  // the whole chunk, which averages away the one key a query matches: on both
  // evaluation models it loses 6-11 points to full attention at the 2048-token
  // budget and most exact copies (docs/evalmodel.md); 4 matches full
  // attention. Selection, fetch and the budget stay per chunk; scoring reads
  // this many times the landmarks, which costs decode throughput (9-10%
  // natural, 24-27% with 60% of chunks forced to miss, at 124928 x 14: bf16
  // landmarks on an H200, fp8 on an H100) and GPU memory (2.15x per token with bf16
  // landmarks, 1.41x with the default fp8 ones: docs/operations.md). A power
  // of two dividing chunk_size, at most 16. Default: 4.
  int landmarks_per_chunk = 4;
  // How the landmarks are stored: "fp8" (OCP e4m3 codes with one f32 scale
  // per chunk, kernels/landmark_format.h) or "model" (the model's activation
  // dtype, bf16 on the GPU). fp8 is about half the bytes of bf16, which every
  // decode step's scoring reads and which the landmarks take of GPU memory
  // (46.0 -> 30.1 KB per token with 4 landmarks per chunk, Llama-3.1-8B
  // shape), for a rounding of each landmark element to 3 mantissa bits (the
  // scale keeps a chunk's largest element at the format's full precision).
  // Measured on both evaluation models at 16K-64K: the same answers as bf16
  // landmarks (docs/evalmodel.md), and at 124928 x 10 on an H100 10-15%
  // faster decode, 14 sequences instead of 10 in its memory. Default: fp8.
  std::string landmark_format = "fp8";
  bool landmark_fp8() const { return landmark_format == "fp8"; }
  // How the offloaded values (the value store's rows, read back every decode
  // step over the host link) are stored: "bf16", the model's activation dtype
  // (bf16 on the GPU, f32 on the CPU backend), or "fp8": OCP e4m3 codes with
  // an f32 scale per token and head (kernels/value_format.h), about half the
  // bytes of bf16, dequantized by the value fetch. The outliers, the local
  // window and the tokens not yet offloaded stay exact. Documents (captured
  // prefixes) keep bf16 values only for now: with fp8 no prefix is cached
  // (every prompt is prefilled whole; answers unchanged). Default: bf16.
  std::string value_format = "bf16";
  bool value_fp8() const { return value_format == "fp8"; }
};

// Every option's flag, YAML key, range, rules and help, declared once
// (common/option_table.h): the flags of `penumbra` and `penumbra-bench`, the
// `shadowkv:` YAML section, the validation and the table in
// docs/operations.md all come from it.
const OptionTable<ShadowKvOptions>& ShadowKvOptionTable();

// The table's flags; Apply overrides `s` only where a flag is given, then
// validates, refusing a bad value naming the flag and the key.
void AddShadowKvFlags(Args& a);
Status ApplyShadowKvFlags(const Args& a, ShadowKvOptions* s);

// Reads `shadowkv:` options (r is the section), then validates; errors name
// the key.
Status LoadShadowKvOptions(ConfigReader& r, ShadowKvOptions* o);
// The table's rules, and the model's geometry (rank <= hkv x head_dim).
Status ValidateShadowKvOptions(const ShadowKvOptions& o, int hkv, int head_dim);

// What the device's kernels take, checked when an engine starts so that a
// configuration they cannot run is a typed error naming the limit, not a
// kernel's check failure: on CUDA a rank of at most 512 (the key rebuild),
// chunks of at most 64 tokens, head_dim a multiple of 8 up to 256 and at most
// 8 query heads per KV head (the scores); on every device a budget of at most
// kShadowKvMaxSelectedChunks chunks (the GPU's top-k; the CPU keeps the same
// limit so that a request behaves alike on both).
inline constexpr int kShadowKvMaxSelectedChunks = 4096;
Status ValidateShadowKvOnDevice(const ShadowKvOptions& o, int hq, int hkv, int head_dim, Device device);

}  // namespace penumbra
