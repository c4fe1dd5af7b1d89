// CPU reference: rotate-half RoPE and the fused RoPE + KV store (see
// kernels/rope_store.cuh). Angles are f32 products position * inv_freq[i], as
// Hugging Face computes them, with f32 cos/sin.
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/ops.h"

namespace penumbra::kernels::cpu {

void ApplyRope(float* x, int heads, int d, int32_t position, const float* inv_freq) {
  const int half = d / 2;
  const float pos = static_cast<float>(position);
  std::vector<float> c(half), s(half);
  for (int i = 0; i < half; ++i) {
    const float angle = pos * inv_freq[i];
    c[i] = std::cos(angle);
    s[i] = std::sin(angle);
  }
  for (int h = 0; h < heads; ++h) {
    float* v = x + static_cast<int64_t>(h) * d;
    for (int i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * c[i] - b * s[i];
      v[i + half] = b * c[i] + a * s[i];
    }
  }
}

void RopeStore(const RopeStoreArgs& a) {
  const int64_t d = a.d;
  const int64_t row = (a.hq + 2 * a.hkv) * d;
  ParallelFor(a.n, [&](int64_t t) {
    const float* src = a.qkv + t * row;
    float* q = a.q_out + t * a.hq * d;
    std::memcpy(q, src, sizeof(float) * a.hq * d);
    ApplyRope(q, a.hq, a.d, a.positions[t], a.inv_freq);
    std::vector<float> k(src + a.hq * d, src + (a.hq + a.hkv) * d);
    if (a.pre_rope_k_out != nullptr) std::memcpy(a.pre_rope_k_out + t * a.hkv * d, k.data(), sizeof(float) * k.size());
    if (a.pre_rope_k_dst != nullptr) std::memcpy(a.pre_rope_k_dst[t], k.data(), sizeof(float) * k.size());
    ApplyRope(k.data(), a.hkv, a.d, a.positions[t], a.inv_freq);
    const float* v = src + (a.hq + a.hkv) * d;
    for (int h = 0; h < a.hkv; ++h) {
      std::memcpy(a.k_dst[t] + h * a.head_stride, k.data() + h * d, sizeof(float) * d);
      if (a.v_dst != nullptr) std::memcpy(a.v_dst[t] + h * a.head_stride, v + h * d, sizeof(float) * d);
    }
  });
}

}  // namespace penumbra::kernels::cpu
