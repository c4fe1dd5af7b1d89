// Exact merge of partial attentions (context parallel): the same query rows
// attended to disjoint parts of the keys on different ranks; each part's
// normalized output and its log-sum-exp are combined by softmax weights,
// out[r] = sum_p w[p][r] x[p][r], w[p][r] = exp(lse[p][r] - m) / sum_p' exp(lse[p'][r] - m),
// m = max_p lse[p][r]. A part with lse = -inf (no key) has weight 0.
// Parallelization: one warp per row; each lane loads its elements of every
// part (f32 accumulate). Traffic: reads parts * rows * d elements once.
#pragma once
#include <cuda_runtime_api.h>
#include "common/dtype.h"

namespace penumbra::kernels {

struct MergeAttentionArgs {
  const void* x = nullptr;  // part p: [rows][d] of dtype at x + p * x_part_stride elements
  int64_t x_part_stride = 0;
  const float* lse = nullptr;  // part p: [rows] at lse + p * lse_part_stride, natural log
  int64_t lse_part_stride = 0;
  int parts = 0, rows = 0, d = 0;
  void* out = nullptr;       // [rows][d] of dtype; may alias part 0 of x
  float* lse_out = nullptr;  // optional [rows]
  DType dtype = DType::kBF16;
};
void LaunchMergeAttention(const MergeAttentionArgs& args, cudaStream_t stream);

}  // namespace penumbra::kernels
