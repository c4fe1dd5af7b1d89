// The engine side of the independent ShadowKV reference check
// (tests/reference/README.md): runs Penumbra's ShadowKV prefill and decode ops
// on one attention layer of one sequence with a static context and returns
// the intermediate decisions (landmarks, outliers, selected chunks, scores)
// and the attention output, in the formats the reference comparator reads.
//
// RunShadowkvCheck runs the policy's own objects (worker/engine/shadowkv/:
// layout, compressor, decode step; see the note at the top of
// shadowkv_check.cc for the mapping); it only differs where the reference's
// setting does: decode steps append no token (the query is RoPE'd at
// position S + i and its K/V go to a row that attention never reads).
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

// Runs prefill (Algorithm 1) and `steps` decode steps (Algorithm 2) on
// `backend` (f32 on the CPU; the CUDA backend's act dtype, bf16 or f32).
// InvalidArgument for inputs ValidateInputs rejects; other errors from the
// backend (allocation, cuSOLVER), Internal if an op breaks its contract
// (e.g. the slot map does not hold the selection afterwards).
Result<CheckResults> RunShadowkvCheck(const CheckInputs& in, Backend& backend);

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

// Writes `r` as the results file (metadata: format, dtype "bf16" | "f32").
Status WriteResults(const CheckResults& r, const std::string& path);

}  // namespace penumbra::shadowkv_check
