#include "kernels/cpu/spindlekv.h"

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/ops.h"

namespace penumbra::kernels::cpu {

void SpindlekvAttention(const SpindlekvAttentionArgs& a) {
  const int d = a.d, G = a.hq / a.hkv, half = d / 2;
  const auto* q = static_cast<const float*>(a.q);
  auto* out = static_cast<float*>(a.out);
  // One (sequence, KV head) per task: each token is rebuilt once for the
  // group's query heads.
  ParallelFor(static_cast<int64_t>(a.batch) * a.hkv, [&](int64_t row) {
    const int64_t b = row / a.hkv;
    const int h = static_cast<int>(row % a.hkv);
    const SpindlekvHead& head = a.heads[row];
    std::vector<double> m(G, -std::numeric_limits<double>::infinity()), l(G, 0.0), acc(static_cast<size_t>(G) * d, 0.0);
    std::vector<float> k(d), v(d);
    for (int p = 0; p < 2; ++p) {
      const SpindlekvTokens& t = head.part[p];
      for (int64_t i = 0; i < t.n; ++i) {
        const uint32_t mask = t.heads[i];
        if (mask == 0) continue;
        const int32_t kr = t.kref[i], vr = t.vref[i];
        const float* ke =
            kr < head.key_base_entries
                ? static_cast<const float*>(head.key_entries[0]) + static_cast<int64_t>(kr) * d
                : static_cast<const float*>(head.key_entries[1]) + static_cast<int64_t>(kr - head.key_base_entries) * d;
        const float* ve = vr < head.value_base_entries
                              ? static_cast<const float*>(head.value_entries[0]) + static_cast<int64_t>(vr) * d
                              : static_cast<const float*>(head.value_entries[1]) +
                                    static_cast<int64_t>(vr - head.value_base_entries) * d;
        for (int e = 0; e < d; ++e) {
          k[e] = ke[e] * t.kmag[i];
          v[e] = ve[e] * t.vmag[i];
        }
        const int32_t p32 = t.pos[i];
        const bool tables = a.rope_cos != nullptr && p32 < a.rope_positions;
        for (int e = 0; e < half; ++e) {
          float c, s;
          if (tables) {
            c = a.rope_cos[static_cast<int64_t>(p32) * half + e];
            s = a.rope_sin[static_cast<int64_t>(p32) * half + e];
          } else {
            const float angle = static_cast<float>(p32) * a.inv_freq[e];
            c = std::cos(angle);
            s = std::sin(angle);
          }
          const float x = k[e], y = k[e + half];
          k[e] = x * c - y * s;
          k[e + half] = y * c + x * s;
        }
        for (int j = 0; j < G; ++j) {
          if (!(mask >> j & 1u)) continue;
          const float* qj = q + (b * a.hq + static_cast<int64_t>(h) * G + j) * d;
          double dot = 0;
          for (int e = 0; e < d; ++e) dot += static_cast<double>(qj[e]) * k[e];
          const double x = dot * a.scale;
          double* aj = &acc[static_cast<size_t>(j) * d];
          if (x > m[j]) {
            const double c = std::exp(m[j] - x);
            l[j] *= c;
            for (int e = 0; e < d; ++e) aj[e] *= c;
            m[j] = x;
          }
          const double w = std::exp(x - m[j]);
          l[j] += w;
          for (int e = 0; e < d; ++e) aj[e] += w * v[e];
        }
      }
    }
    for (int j = 0; j < G; ++j) {
      const int64_t qh = b * a.hq + static_cast<int64_t>(h) * G + j;
      float* o = out + qh * d;
      for (int e = 0; e < d; ++e)
        o[e] = l[j] > 0 ? static_cast<float>(acc[static_cast<size_t>(j) * d + e] / l[j]) : 0.0f;
      if (a.lse != nullptr) {
        a.lse[qh] = l[j] > 0 ? static_cast<float>(m[j] + std::log(l[j])) : -std::numeric_limits<float>::infinity();
      }
    }
  });
}

}  // namespace penumbra::kernels::cpu
