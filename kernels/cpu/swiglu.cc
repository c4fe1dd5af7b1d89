// CPU reference: SwiGLU (see kernels/swiglu.cuh).
#include <cmath>

#include "kernels/cpu/ops.h"

namespace penumbra::kernels::cpu {

void SwiGLU(const float* gate_up, int n, int F, float* out) {
  ParallelFor(n, [&](int64_t i) {
    const float* g = gate_up + i * 2 * F;
    const float* u = g + F;
    float* o = out + i * F;
    for (int j = 0; j < F; ++j) o[j] = (g[j] / (1.0f + std::exp(-g[j]))) * u[j];
  });
}

}  // namespace penumbra::kernels::cpu
