// CPU reference: bias add (see kernels/add_bias.cuh).
#include "kernels/cpu/ops.h"

namespace penumbra::kernels::cpu {

void AddBias(float* x, const float* bias, int n, int dim) {
  for (int64_t i = 0; i < n; ++i) {
    float* r = x + i * dim;
    for (int j = 0; j < dim; ++j) r[j] += bias[j];
  }
}

}  // namespace penumbra::kernels::cpu
