// Causal prefill attention with GQA for one sequence, over its KV cache.
//
// Queries are the nq tokens at positions q_start .. q_start+nq-1; query i
// attends keys 0 .. q_start+i (the cache already holds them, including the
// chunk's own keys). Online softmax (FlashAttention-2 style): each block owns a
// tile of queries of one query head and streams K/V tiles through shared
// memory; the fast paths use bf16 tensor cores for d in {64, 128} (wgmma on
// Hopper, mma.sync elsewhere); a generic path serves f32 and other head dims. Output in q's dtype.
#pragma once
#include <cuda_runtime_api.h>
#include <cstdint>
#include "common/dtype.h"

namespace penumbra::kernels {

// Which kernel runs: kAuto picks wgmma on Hopper (compute capability 9.0)
// for bf16 with d in {64, 128}, the mma.sync kernel for those elsewhere, and
// the generic kernel otherwise. A path that does not apply to the arguments
// falls back the same way (tests and benchmarks force each one).
enum class PrefillPath { kAuto, kWgmma, kMma, kGeneric };

struct PrefillAttentionArgs {
  const void* q = nullptr;     // [nq, hq, d]
  const void* k = nullptr;     // cache base of this sequence: [hkv][head_stride] rows of d
  const void* v = nullptr;     // same layout as k
  void* out = nullptr;         // [nq, hq, d], same dtype as q
  float* lse = nullptr;        // optional [nq, hq]: ln sum exp(scale q.k) over each row's keys (cascade merges)
  DType dtype = DType::kBF16;  // dtype of q, k, v and out (f32 or bf16)
  int64_t head_stride = 0;     // elements between KV heads (capacity * d)
  int q_start = 0, nq = 0, hq = 0, hkv = 0, d = 0;
  float scale = 1.0f;  // usually 1/sqrt(d)
  PrefillPath path = PrefillPath::kAuto;
};

void LaunchPrefillAttention(const PrefillAttentionArgs& args, cudaStream_t stream);

}  // namespace penumbra::kernels
