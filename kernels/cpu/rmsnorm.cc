// CPU reference: RMSNorm (see kernels/rmsnorm.cuh). The sum of squares is
// accumulated in double so the reference is more accurate than any f32 order.
#include <cmath>

#include "kernels/cpu/ops.h"

namespace penumbra::kernels::cpu {

void RmsNorm(const float* x, const float* w, int n, int dim, float eps, float* out) {
  ParallelFor(n, [&](int64_t i) {
    const float* xr = x + i * dim;
    float* o = out + i * dim;
    double ss = 0.0;
    for (int j = 0; j < dim; ++j) ss += static_cast<double>(xr[j]) * xr[j];
    const float mean = static_cast<float>(ss) / static_cast<float>(dim);
    const float r = 1.0f / std::sqrt(mean + eps);
    for (int j = 0; j < dim; ++j) o[j] = (xr[j] * r) * w[j];
  });
}

}  // namespace penumbra::kernels::cpu
