// Helpers of the ShadowKV check tests: synthetic inputs, a double-precision
// RoPE and attention, and writing an inputs file.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "worker/bench/shadowkv_check.h"

namespace penumbra::shadowkv_check::testing {

struct SynthOptions {
  int seq = 200, hkv = 2, group = 2, d = 64, rank = 128, chunk = 8, outliers = 0, local_window = 16, steps = 3;
  int64_t budget = -1;  // < 0: all non-outlier chunks
  uint64_t seed = 1;
  // Structured keys (each chunk along one direction, chunks in `odd_chunks`
  // alternating +-direction so they are clear outliers) and queries aimed at
  // one token each (peaked attention); otherwise i.i.d. normal.
  bool structured = false;
  std::vector<int> odd_chunks;
};

// inv_freq for theta 10000, computed in f32 as Hugging Face does.
inline std::vector<float> InvFreq(int d) {
  std::vector<float> f(d / 2);
  for (int i = 0; i < d / 2; ++i) f[i] = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / static_cast<float>(d));
  return f;
}

// Rotate-half RoPE of x (d values) at `pos`, angle = f32(pos) * inv_freq (f32), cos/sin in double.
inline std::vector<double> Rope(const double* x, int d, int64_t pos, const std::vector<float>& inv_freq,
                                double sign = 1.0) {
  std::vector<double> y(d);
  const int half = d / 2;
  for (int i = 0; i < half; ++i) {
    const double a = sign * static_cast<double>(static_cast<float>(pos) * inv_freq[i]);
    const double c = std::cos(a), s = std::sin(a);
    y[i] = x[i] * c - x[i + half] * s;
    y[i + half] = x[i + half] * c + x[i] * s;
  }
  return y;
}
inline std::vector<double> Rope(const float* x, int d, int64_t pos, const std::vector<float>& inv_freq) {
  std::vector<double> xd(x, x + d);
  return Rope(xd.data(), d, pos, inv_freq);
}

inline CheckInputs MakeInputs(const SynthOptions& o) {
  CheckInputs in;
  in.hkv = o.hkv;
  in.seq = o.seq;
  in.d = o.d;
  in.hq = o.hkv * o.group;
  in.steps = o.steps;
  in.rank = o.rank;
  in.chunk = o.chunk;
  in.outliers = o.outliers;
  in.local_window = o.local_window;
  in.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(o.d)));
  in.budget = o.budget >= 0 ? o.budget : static_cast<int64_t>(in.n_chunks() - o.outliers) * o.chunk;
  in.inv_freq = InvFreq(o.d);
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  const size_t n = static_cast<size_t>(o.hkv) * o.seq * o.d;
  in.k_pre.resize(n);
  in.v.resize(n);
  for (auto& x : in.v) x = static_cast<float>(nd(rng));
  const std::set<int> odd(o.odd_chunks.begin(), o.odd_chunks.end());
  for (int h = 0; h < o.hkv; ++h) {
    std::vector<double> u(o.d);
    for (int t = 0; t < o.seq; ++t) {
      float* k = in.k_pre.data() + (static_cast<size_t>(h) * o.seq + t) * o.d;
      if (!o.structured) {
        for (int i = 0; i < o.d; ++i) k[i] = static_cast<float>(nd(rng));
        continue;
      }
      if (t % o.chunk == 0) {
        for (auto& x : u) x = nd(rng);
      }
      const double sign = odd.count(t / o.chunk) && (t % 2) ? -1.0 : 1.0;
      for (int i = 0; i < o.d; ++i) k[i] = static_cast<float>(sign * u[i] + 0.3 * nd(rng));
    }
  }
  in.q.resize(static_cast<size_t>(o.steps) * in.hq * o.d);
  std::uniform_int_distribution<int> pick(0, o.seq - 1);
  for (int s = 0; s < o.steps; ++s) {
    for (int j = 0; j < in.hq; ++j) {
      float* q = in.q.data() + (static_cast<size_t>(s) * in.hq + j) * o.d;
      if (!o.structured) {
        for (int i = 0; i < o.d; ++i) q[i] = static_cast<float>(nd(rng));
        continue;
      }
      // Post-RoPE aligned with a target token's key (logit ~ 8), 30 % noise,
      // then rotated back to the query's position.
      const int h = j / o.group, t = pick(rng);
      const auto k = Rope(in.k_pre.data() + (static_cast<size_t>(h) * o.seq + t) * o.d, o.d, t, in.inv_freq);
      double k2 = 0;
      for (double x : k) k2 += x * x;
      const double alpha = 8.0 / (in.scale * k2);
      std::vector<double> qp(o.d);
      for (int i = 0; i < o.d; ++i) qp[i] = alpha * k[i] + 0.3 * alpha * std::sqrt(k2 / o.d) * nd(rng);
      const auto qpre = Rope(qp.data(), o.d, o.seq + s, in.inv_freq, -1.0);
      for (int i = 0; i < o.d; ++i) q[i] = static_cast<float>(qpre[i]);
    }
  }
  return in;
}

// Writes `in` as an inputs file, leaving out tensor `skip` and applying
// metadata overrides (an empty value removes the key).
inline Status WriteInputs(const CheckInputs& in, const std::string& path, const std::string& skip = "",
                          const std::map<std::string, std::string>& meta_override = {}) {
  std::vector<OutTensor> t;
  auto add = [&](const char* name, std::vector<int64_t> shape, const std::vector<float>& x) {
    if (skip != name) t.push_back({name, DType::kF32, std::move(shape), x.data()});
  };
  add("k_pre", {in.hkv, in.seq, in.d}, in.k_pre);
  add("v", {in.hkv, in.seq, in.d}, in.v);
  add("q", {in.steps, in.hq, in.d}, in.q);
  add("inv_freq", {in.d / 2}, in.inv_freq);
  char scale[64];
  std::snprintf(scale, sizeof(scale), "%.17g", static_cast<double>(in.scale));
  std::map<std::string, std::string> meta = {
      {"rank", std::to_string(in.rank)},
      {"chunk", std::to_string(in.chunk)},
      {"budget", std::to_string(in.budget)},
      {"outliers", std::to_string(in.outliers)},
      {"local_window", std::to_string(in.local_window)},
      {"steps", std::to_string(in.steps)},
      {"scale", scale},
      {"rope_theta", "10000.0"},
      {"format", "penumbra-shadowkv-check-inputs/1"},
  };
  for (const auto& [k, v] : meta_override) {
    if (v.empty()) {
      meta.erase(k);
    } else {
      meta[k] = v;
    }
  }
  return WriteSafetensors(path, t, meta);
}

// Post-RoPE keys [hkv][seq][d] in double.
inline std::vector<double> RopedKeys(const CheckInputs& in) {
  std::vector<double> k(static_cast<size_t>(in.hkv) * in.seq * in.d);
  for (int h = 0; h < in.hkv; ++h) {
    for (int t = 0; t < in.seq; ++t) {
      const size_t off = (static_cast<size_t>(h) * in.seq + t) * in.d;
      const auto r = Rope(in.k_pre.data() + off, in.d, t, in.inv_freq);
      std::copy(r.begin(), r.end(), k.begin() + off);
    }
  }
  return k;
}

// Softmax attention in double of query head j at `step` over the exact
// post-RoPE keys of `tokens` (all tokens when empty). Returns d values.
inline std::vector<double> Attend(const CheckInputs& in, const std::vector<double>& k_rope, int step, int j,
                                  const std::vector<int>& tokens) {
  const int d = in.d, h = j / in.group();
  const auto q = Rope(in.q.data() + (static_cast<size_t>(step) * in.hq + j) * d, d, in.seq + step, in.inv_freq);
  std::vector<int> toks = tokens;
  if (toks.empty()) {
    for (int t = 0; t < in.seq; ++t) toks.push_back(t);
  }
  std::vector<double> logit(toks.size());
  double mx = -1e300;
  for (size_t i = 0; i < toks.size(); ++i) {
    const double* k = k_rope.data() + (static_cast<size_t>(h) * in.seq + toks[i]) * d;
    double s = 0;
    for (int x = 0; x < d; ++x) s += q[x] * k[x];
    logit[i] = s * in.scale;
    mx = std::max(mx, logit[i]);
  }
  std::vector<double> out(d, 0.0);
  double sum = 0;
  for (size_t i = 0; i < toks.size(); ++i) {
    const double p = std::exp(logit[i] - mx);
    sum += p;
    const float* v = in.v.data() + (static_cast<size_t>(h) * in.seq + toks[i]) * d;
    for (int x = 0; x < d; ++x) out[x] += p * v[x];
  }
  for (double& x : out) x /= sum;
  return out;
}

}  // namespace penumbra::shadowkv_check::testing
