// Token selection from logits: greedy argmax, or temperature / top-k / top-p
// sampling by inverse CDF with a caller-provided uniform number per row (so the
// CPU and CUDA backends pick the same token from the same logits and seed).
// One block per row; several passes over the row's vocab (bandwidth bound).
#pragma once
#include <cuda_runtime_api.h>
#include <cstdint>

namespace penumbra::kernels {

struct SamplingRow {
  float temperature = 0.0f;  // <= 0: greedy
  int top_k = 0;             // 0: no top-k cut
  float top_p = 1.0f;        // 1: no nucleus cut
  float uniform = 0.0f;      // in [0, 1)
};

// logits: [rows, vocab] f32; params: device [rows]; out: device [rows].
void LaunchSample(const float* logits, int rows, int vocab, const SamplingRow* params, int32_t* out,
                  cudaStream_t stream);

}  // namespace penumbra::kernels
