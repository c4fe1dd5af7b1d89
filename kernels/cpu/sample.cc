// CPU reference: token selection (see kernels/sample.cuh). This file defines
// the exact semantics the CUDA kernel reproduces:
//   temperature <= 0: argmax of the logits, lowest index among equal maxima.
//   otherwise, with f32 z = logit / T, m = max z, e = expf(z - m),
//   S = sum e (accumulated in double, then rounded to f32), p = e / S (f32):
//   1. top_k in (0, vocab): keep tokens whose logit >= the k-th largest logit
//      (ties at the k-th value are all kept).
//   2. top_p < 1: over the kept tokens in descending logit order, find the first
//      token at which the cumulative p reaches top_p * K (K = kept mass); keep
//      the tokens whose logit >= that token's logit.
//   3. W = kept mass; scanning token ids ascending, return the first kept id at
//      which the running kept mass exceeds uniform * W, else the last kept id.
// Masses are accumulated in double. Logits must not be NaN and at least one
// must be finite when sampling.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu/ops.h"

namespace penumbra::kernels::cpu {

namespace {

int32_t Argmax(const float* logits, int vocab) {
  float best = -std::numeric_limits<float>::infinity();
  int32_t idx = -1;
  for (int i = 0; i < vocab; ++i) {
    if (logits[i] > best || (idx < 0 && logits[i] == best)) {
      best = logits[i];
      idx = i;
    }
  }
  return idx < 0 ? 0 : idx;
}

}  // namespace

int32_t Sample(const float* logits, int vocab, const SamplingRow& p) {
  if (!(p.temperature > 0.0f)) return Argmax(logits, vocab);  // NaN temperature too
  const float t = p.temperature;
  float m = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < vocab; ++i) m = std::max(m, logits[i] / t);
  std::vector<float> e(vocab);
  double s = 0.0;
  for (int i = 0; i < vocab; ++i) {
    e[i] = std::exp(logits[i] / t - m);
    s += e[i];
  }
  const float sf = static_cast<float>(s);
  std::vector<float> prob(vocab);
  for (int i = 0; i < vocab; ++i) prob[i] = e[i] / sf;

  std::vector<char> kept(vocab, 1);
  if (p.top_k > 0 && p.top_k < vocab) {
    std::vector<float> sorted(logits, logits + vocab);
    std::nth_element(sorted.begin(), sorted.begin() + (p.top_k - 1), sorted.end(), std::greater<float>());
    const float kth = sorted[p.top_k - 1];
    for (int i = 0; i < vocab; ++i) kept[i] = logits[i] >= kth;
  }
  if (p.top_p < 1.0f) {
    std::vector<int32_t> order;
    double kept_mass = 0.0;
    for (int i = 0; i < vocab; ++i) {
      if (kept[i]) {
        order.push_back(i);
        kept_mass += prob[i];
      }
    }
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    const double target = static_cast<double>(p.top_p) * kept_mass;
    float cut = logits[order.back()];  // if rounding keeps cum below target: keep all
    double cum = 0.0;
    for (int32_t id : order) {
      cum += prob[id];
      if (cum >= target) {
        cut = logits[id];
        break;
      }
    }
    for (int i = 0; i < vocab; ++i) kept[i] = kept[i] && logits[i] >= cut;
  }
  double total = 0.0;
  int32_t last = 0;
  for (int i = 0; i < vocab; ++i) {
    if (kept[i]) {
      total += prob[i];
      last = i;
    }
  }
  const double target = static_cast<double>(p.uniform) * total;
  double run = 0.0;
  for (int i = 0; i < vocab; ++i) {
    if (!kept[i]) continue;
    run += prob[i];
    if (run > target) return i;
  }
  return last;
}

}  // namespace penumbra::kernels::cpu
