// The engine side of the independent ShadowKV reference check
// (tests/reference/README.md): runs Penumbra's ShadowKV prefill and decode on
// one attention layer of one sequence with a static context and returns the
// intermediate decisions (landmarks, outliers, selected chunks, scores) and
// the attention output, in the formats the reference comparator reads.
//
// RunShadowkvCheck runs the policy's own objects (worker/engine/shadowkv/:
// layout, compressor, decode step, shard exchange, prefix capture/attach; see
// the note at the top of shadowkv_check.cc for the mapping) in one of three
// modes, each the path a sequence takes in the engine:
//   direct    the context is the sequence's prompt: compressed, then decoded;
//   attached  the context is a document: compressed as a put's prefill,
//             taken into a prefix (ShadowKvPrefixIo::Capture), exported to
//             blobs and imported fresh, attached to a new sequence (Fit,
//             Allocate, Attach) whose decode steps read its A rows,
//             landmarks and values in place;
//   cp2       context parallel over 2 ranks in this process: each rank holds
//             Runtime::ShardOf's shard (factored on its own, its share of the
//             outliers), every step's selection is the global one through
//             the shard exchange over a LockstepGroup, and the ranks'
//             attention is merged by log-sum-exp as the runtime merges them.
// Every mode writes the whole sequence's results (original chunk ids), so
// the same comparator judges them. Attaching changes nothing (on the CPU
// backend attached equals direct bit for bit); sharding changes the low-rank
// factors and the outliers (per shard; the comparator's reference models
// it), so cp2 equals direct only up to float rounding where neither matters
// (rank = hkv*d, outliers that fall in each shard's share).
// The check differs from the engine only where the reference's setting
// does: decode steps append no token (the query is RoPE'd at position S + i
// and its K/V go to a row that attention never reads).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "worker/engine/backend.h"

namespace penumbra::shadowkv_check {

// The inputs file (format "penumbra-shadowkv-check-inputs/1").
struct CheckInputs {
  int hkv = 0, seq = 0, d = 0, hq = 0, steps = 0;
  std::vector<float> k_pre;     // [hkv, seq, d] pre-RoPE keys; token t at position t
  std::vector<float> v;         // [hkv, seq, d]
  std::vector<float> q;         // [steps, hq, d] pre-RoPE queries; step i at position seq + i
  std::vector<float> inv_freq;  // [d / 2] RoPE inverse frequencies
  int rank = 0;                 // SVD rank r
  int chunk = 0;                // chunk size C (tokens)
  int64_t budget = 0;           // tokens; kslots = budget / chunk
  int outliers = 0;             // outlier chunks per KV head O
  int local_window = 0;         // W; n_chunks = (seq - W) / C
  float scale = 0.0f;           // softmax scale

  int group() const { return hkv > 0 ? hq / hkv : 0; }
  int n_chunks() const { return chunk > 0 ? (seq - local_window) / chunk : 0; }
  int kslots() const { return chunk > 0 ? static_cast<int>(budget / chunk) : 0; }
};

// The results file the comparator reads.
struct CheckResults {
  std::string mode = "direct";        // metadata "mode"
  std::vector<int64_t> shard_bounds;  // cp: the shards' first tokens, then seq (metadata "shards")
  int hkv = 0, n_chunks = 0, d = 0, hq = 0, steps = 0, outliers = 0, kslots = 0;
  DType dtype = DType::kF32;         // the engine's storage/compute dtype (metadata "dtype")
  std::vector<float> landmarks;      // [hkv, n_chunks, d], original chunk numbering
  std::vector<int32_t> outlier_ids;  // [hkv, outliers], strictly ascending
  std::vector<int32_t> selected;     // [steps, hkv, kslots], strictly ascending, original ids
  std::vector<float> out;            // [steps, hq, d]
  std::vector<float> scores;         // [steps, hkv, n_chunks]; -inf at outlier chunks
};

// Checks shapes and the README's constraints, plus the engine's kernel limits
// (d % 8 == 0, d <= 256, group <= 8, chunk <= 64, rank <= 512, local_window
// >= 1, kslots <= 4096). InvalidArgument naming the field or metadata key.
Status ValidateInputs(const CheckInputs& in);

// Reads and validates an inputs file. InvalidArgument (bad tensor, dtype,
// shape or metadata, naming it), NotFound / Corruption / IOError from the
// safetensors reader.
Result<CheckInputs> ReadInputs(const std::string& path);

// The modes RunShadowkvCheck takes: "direct", "attached", "cp2".
const std::vector<std::string>& CheckModes();
// InvalidArgument naming the modes unless `mode` is one.
Status ValidateMode(const std::string& mode);

// Runs prefill (Algorithm 1) and `steps` decode steps (Algorithm 2) on
// `backend` (f32 on the CPU; the CUDA backend's act dtype, bf16 or f32) in
// `mode` (above). InvalidArgument for an unknown mode, for inputs
// ValidateInputs rejects and, in cp2, for inputs whose shards cannot hold
// the whole sequence's results (a shard boundary inside a chunk, a shard
// too short to select from, the shards' outliers not the inputs' count);
// other errors from the backend (allocation, cuSOLVER), Internal if an op
// breaks its contract (e.g. the slot map does not hold the selection
// afterwards).
Result<CheckResults> RunShadowkvCheck(const CheckInputs& in, Backend& backend, const std::string& mode = "direct");

// A tensor to write; `data` holds numel * DTypeSize(dtype) bytes.
struct OutTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// Writes a safetensors file (8-byte little-endian header length, JSON header
// padded with spaces to a multiple of 8, then the tensors in the given order)
// to `path` via a temporary file and a rename: on failure nothing is left at
// `path`. IOError on a write failure.
Status WriteSafetensors(const std::string& path, const std::vector<OutTensor>& tensors,
                        const std::map<std::string, std::string>& metadata);

// Writes `r` as the results file (metadata: format, dtype "bf16" | "f32",
// mode, and for cp the shard bounds "0,b1,...,seq").
Status WriteResults(const CheckResults& r, const std::string& path);

}  // namespace penumbra::shadowkv_check
