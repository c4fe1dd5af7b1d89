// Fills a buffer with N(0, std) values from a counter-based hash (each element
// is a pure function of (seed, index)), so results do not depend on the launch
// shape. Used for benchmarks' random weights and KV caches, generated on the
// GPU. Memory bound: one write per element.
#pragma once
#include <cuda_runtime_api.h>
#include <cstdint>
#include "common/dtype.h"

namespace penumbra::kernels {
void LaunchFillRandomNormal(void* dst, DType dtype, int64_t n, float std, uint64_t seed, cudaStream_t stream);
}  // namespace penumbra::kernels
