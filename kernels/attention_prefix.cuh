// Prefix attention (cascade attention's shared half): the query rows of
// several sequences that share ONE copy of a prompt prefix's exact K/V (a
// document held once in device memory) attend to all of its keys (no causal
// mask: every prefix key precedes every query), and the result is merged by
// log-sum-exp into each row's attention over its own keys (the question and
// the generated tokens, computed before by the decode or prefill kernel with
// its log-sum-exp).
//
// For a kv head, the rows are (sequence, query head of the group): n * hq/hkv
// rows that all read the same K/V, so the prefix is one tall matrix product
// per kv head instead of n memory-bound decodes: tensor-core work that reads
// the prefix once per step, however many sequences share it.
//
// Phase 1: grid (row tiles, kv head, key splits); each block computes its rows
// over its split's keys (online softmax) and writes the normalized partial
// output and its log2-sum-exp to the workspace. Phase 2: one block per
// (query head, row) merges the splits and the row's own part into `out`.
#pragma once
#include <cuda_runtime_api.h>
#include <cstddef>
#include <cstdint>
#include "common/dtype.h"

namespace penumbra::kernels {

// kAuto: warpgroup MMA on Hopper for bf16 with d in {64, 128}, the generic
// kernel otherwise (tests force each).
enum class PrefixPath { kAuto, kWgmma, kGeneric };

struct PrefixAttentionArgs {
  const void* q = nullptr;        // [batch, hq, d], RoPE applied
  const int32_t* rows = nullptr;  // device [n]: the batch rows (sequences) attached to this prefix, distinct
  int n = 0;
  const void* k = nullptr;  // the prefix's keys of one layer: [hkv][head_stride] rows of d
  const void* v = nullptr;  // same layout as k
  int64_t head_stride = 0;
  int keys = 0;  // prefix tokens (>= 1)
  // [batch, hq, d], same dtype as q. With own_lse: on entry each listed row's
  // attention over its own keys (normalized), on exit the attention over the
  // prefix and its own keys. Without: overwritten with the prefix's part.
  void* out = nullptr;
  const float* own_lse = nullptr;  // device [batch, hq]: ln sum exp(scale q.k) over the row's own keys; or null
  // device [batch, hq] or null: each listed row's log-sum-exp of what out
  // holds on exit (the prefix's part, or the merged one with own_lse), for a
  // later merge with other parts. May alias own_lse.
  float* lse_out = nullptr;
  DType dtype = DType::kBF16;  // q, k, v and out: f32, f16 or bf16
  int hq = 0, hkv = 0, d = 0;
  float scale = 1.0f;
  void* workspace = nullptr;  // PrefixAttentionWorkspaceBytes() bytes
  size_t workspace_bytes = 0;
  PrefixPath path = PrefixPath::kAuto;
};

size_t PrefixAttentionWorkspaceBytes(int n, int hq, int hkv, int d, int keys);
void LaunchPrefixAttention(const PrefixAttentionArgs& args, cudaStream_t stream);

}  // namespace penumbra::kernels
