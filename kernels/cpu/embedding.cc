// CPU reference: embedding lookup (see kernels/embedding.cuh).
#include <cstring>

#include "kernels/cpu/ops.h"

namespace penumbra::kernels::cpu {

void Embedding(const float* table, const int32_t* ids, int n, int dim, float* out) {
  for (int i = 0; i < n; ++i) {
    std::memcpy(out + static_cast<int64_t>(i) * dim, table + static_cast<int64_t>(ids[i]) * dim,
                sizeof(float) * static_cast<size_t>(dim));
  }
}

}  // namespace penumbra::kernels::cpu
