// Embedding lookup: out[i, :] = f32(table[ids[i], :]).
// One block per token row, 16-byte loads; memory bound (reads n*dim elements).
#pragma once
#include <cuda_runtime_api.h>
#include <cstdint>
#include "common/dtype.h"

namespace penumbra::kernels {
// table: [vocab, dim] of table_dtype; ids: [n] (device; every id < vocab,
// checked by the caller); out: [n, dim] f32.
void LaunchEmbedding(const void* table, DType table_dtype, const int32_t* ids, int n, int dim, float* out,
                     cudaStream_t stream);
}  // namespace penumbra::kernels
