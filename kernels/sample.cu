// Token selection from logits (semantics: kernels/cpu/sample.cc, the reference).
// Algorithm, one block per row, no sort and no workspace:
//   greedy: block argmax (lowest index among equal maxima).
//   sampling: pass 1 max/min logit (m = max/T); pass 2 S = sum expf(z - m)
//   (double partials). Top-k and top-p thresholds are found by a deterministic
//   8-way search over the order-preserving 32-bit key of the logits: each pass
//   splits the remaining key range into 8 buckets and sums a weight per bucket
//   (1 for top-k's count, p for top-p's mass, in double), keeping the bucket
//   that holds the largest key whose "mass at or above" still reaches the
//   target (~11 passes; top-p only evaluates expf for logits inside the current
//   range). Then the kept mass W, and an ascending-id block scan (double) finds
//   the first id whose running mass exceeds uniform * W.
// Parallelization: kThreads threads per row, 16-byte logit loads when the row
// allows; every reduction has a fixed order, so results are deterministic.
// Memory traffic: ~4 full passes + ~11 search passes per cut over the row's
// vocab*4 bytes; after the first pass the row is served from L2.
#include "kernels/sample.cuh"

#include <cfloat>
#include <climits>
#include <cstdint>

#include "kernels/common.cuh"

namespace penumbra::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBuckets = 8;
constexpr int kItems = 4;  // contiguous logits per thread in the final scan

// Order-preserving map of a float (not NaN) to uint32; -0 maps like +0.
__device__ __forceinline__ uint32_t Key(float f) {
  uint32_t u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Calls fn(i, logit) for this thread's share of the row.
template <typename Fn>
__device__ __forceinline__ void ForEachLogit(const float* row, int vocab, bool vec, Fn fn) {
  if (vec) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    for (int q = threadIdx.x; q < vocab / 4; q += kThreads) {
      const float4 v = r4[q];
      fn(4 * q, v.x);
      fn(4 * q + 1, v.y);
      fn(4 * q + 2, v.z);
      fn(4 * q + 3, v.w);
    }
  } else {
    for (int i = threadIdx.x; i < vocab; i += kThreads) fn(i, row[i]);
  }
}

__device__ __forceinline__ double WarpSumD(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct Shared {
  double d[kWarps][kBuckets];
  float f[kWarps][2];
  int i[kWarps];
  double scalar;
};

// Sums kBuckets doubles over the block; every thread gets the totals.
__device__ void BlockSum(double (&v)[kBuckets], Shared& sh) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int b = 0; b < kBuckets; ++b) v[b] = WarpSumD(v[b]);
  if (lane == 0) {
#pragma unroll
    for (int b = 0; b < kBuckets; ++b) sh.d[warp][b] = v[b];
  }
  __syncthreads();
#pragma unroll
  for (int b = 0; b < kBuckets; ++b) {
    double s = 0.0;
    for (int w = 0; w < kWarps; ++w) s += sh.d[w][b];
    v[b] = s;
  }
  __syncthreads();
}

__device__ double BlockSum1(double v, Shared& sh) {
  double a[kBuckets] = {v};
  BlockSum(a, sh);
  return a[0];
}

__device__ int BlockMinInt(int v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) sh.i[threadIdx.x / 32] = v;
  __syncthreads();
  int r = INT_MAX;
  for (int w = 0; w < kWarps; ++w) r = min(r, sh.i[w]);
  __syncthreads();
  return r;
}

__device__ int BlockMaxInt(int v, Shared& sh) { return -BlockMinInt(-v, sh); }

// Block argmax of the logits: lowest index among equal maxima; 0 if all NaN.
__device__ int Argmax(const float* row, int vocab, bool vec, Shared& sh) {
  float best = -INFINITY;
  int idx = INT_MAX;
  ForEachLogit(row, vocab, vec, [&](int i, float x) {
    if (x > best || (x == best && i < idx)) {
      best = x;
      idx = i;
    }
  });
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ob > best || (ob == best && oi < idx)) {
      best = ob;
      idx = oi;
    }
  }
  if (threadIdx.x % 32 == 0) {
    sh.f[threadIdx.x / 32][0] = best;
    sh.i[threadIdx.x / 32] = idx;
  }
  __syncthreads();
  best = -INFINITY;
  idx = INT_MAX;
  for (int w = 0; w < kWarps; ++w) {
    const float ob = sh.f[w][0];
    const int oi = sh.i[w];
    if (ob > best || (ob == best && oi < idx)) {
      best = ob;
      idx = oi;
    }
  }
  __syncthreads();
  return idx == INT_MAX ? 0 : idx;
}

struct Softmax {
  float inv_t_div;  // temperature (divided by, IEEE division like the reference)
  float m;          // max of logit / temperature
  float sum;        // f32(sum of expf(z - m))
  __device__ __forceinline__ float P(float logit) const { return expf(logit / inv_t_div - m) / sum; }
};

// Returns the largest key c in [lo, hi) whose weight at or above c (elements
// with key >= c; mass_hi is the weight of those with key >= hi) reaches target.
// The caller guarantees it holds for c = lo (else lo is returned).
template <bool kProb>
__device__ uint32_t SearchKey(const float* row, int vocab, bool vec, uint64_t lo, uint64_t hi, double target,
                              double mass_hi, const Softmax& sm, Shared& sh) {
  while (hi - lo > 1) {
    int shift = 0;
    while (((hi - lo - 1) >> shift) >= static_cast<uint64_t>(kBuckets)) ++shift;
    double acc[kBuckets] = {};
    ForEachLogit(row, vocab, vec, [&](int, float x) {
      const uint64_t k = Key(x);
      if (k < lo || k >= hi) return;
      const int b = static_cast<int>((k - lo) >> shift);
      const double w = kProb ? static_cast<double>(sm.P(x)) : 1.0;
#pragma unroll
      for (int j = 0; j < kBuckets; ++j) acc[j] += (j == b) ? w : 0.0;
    });
    BlockSum(acc, sh);
    int sel = 0;
    double above = mass_hi;  // weight at or above the upper end of bucket j
    double sel_above = -1.0;
    for (int j = kBuckets - 1; j >= 0; --j) {
      const double at = above + acc[j];
      if (at >= target) {
        sel = j;
        sel_above = above;
        break;
      }
      above = at;
    }
    if (sel_above < 0.0) sel_above = above - acc[0];  // rounding: fall back to the lowest bucket
    const uint64_t new_lo = lo + (static_cast<uint64_t>(sel) << shift);
    const uint64_t new_hi = new_lo + (uint64_t{1} << shift);
    lo = new_lo;
    hi = new_hi < hi ? new_hi : hi;
    mass_hi = sel_above;
  }
  return static_cast<uint32_t>(lo);
}

__global__ void __launch_bounds__(kThreads)
    SampleKernel(const float* __restrict__ logits, int vocab, const SamplingRow* __restrict__ params,
                 int32_t* __restrict__ out) {
  __shared__ Shared sh;
  const int r = blockIdx.x;
  const float* row = logits + static_cast<int64_t>(r) * vocab;
  const bool vec = vocab % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  const SamplingRow p = params[r];
  if (!(p.temperature > 0.0f)) {
    const int idx = Argmax(row, vocab, vec, sh);
    if (threadIdx.x == 0) out[r] = idx;
    return;
  }

  // Pass 1: max and min logit.
  float mx = -INFINITY, mn = INFINITY;
  ForEachLogit(row, vocab, vec, [&](int, float x) {
    mx = fmaxf(mx, x);
    mn = fminf(mn, x);
  });
  mx = WarpMax(mx);
  mn = -WarpMax(-mn);
  if (threadIdx.x % 32 == 0) {
    sh.f[threadIdx.x / 32][0] = mx;
    sh.f[threadIdx.x / 32][1] = mn;
  }
  __syncthreads();
  mx = -INFINITY;
  mn = INFINITY;
  for (int w = 0; w < kWarps; ++w) {
    mx = fmaxf(mx, sh.f[w][0]);
    mn = fminf(mn, sh.f[w][1]);
  }
  __syncthreads();

  // Pass 2: softmax denominator.
  Softmax sm{p.temperature, mx / p.temperature, 1.0f};
  double s = 0.0;
  ForEachLogit(row, vocab, vec, [&](int, float x) { s += static_cast<double>(expf(x / sm.inv_t_div - sm.m)); });
  sm.sum = static_cast<float>(BlockSum1(s, sh));

  const uint64_t key_hi = uint64_t{Key(mx)} + 1;
  uint32_t cut = Key(mn);  // keep logits whose key >= cut
  if (p.top_k > 0 && p.top_k < vocab) {
    cut = SearchKey<false>(row, vocab, vec, cut, key_hi, static_cast<double>(p.top_k), 0.0, sm, sh);
  }
  if (p.top_p < 1.0f) {
    double kept = 0.0;
    ForEachLogit(row, vocab, vec, [&](int, float x) {
      if (Key(x) >= cut) kept += static_cast<double>(sm.P(x));
    });
    kept = BlockSum1(kept, sh);
    cut = SearchKey<true>(row, vocab, vec, cut, key_hi, static_cast<double>(p.top_p) * kept, 0.0, sm, sh);
  }

  // Kept mass and last kept id.
  double total = 0.0;
  int last = -1;
  ForEachLogit(row, vocab, vec, [&](int i, float x) {
    if (Key(x) >= cut) {
      total += static_cast<double>(sm.P(x));
      last = max(last, i);
    }
  });
  total = BlockSum1(total, sh);
  last = BlockMaxInt(last, sh);
  const double target = static_cast<double>(p.uniform) * total;

  // Ascending scan: tiles of kThreads * kItems ids, kItems contiguous per thread.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  double carry = 0.0;
  for (int base = 0; base < vocab; base += kThreads * kItems) {
    const int first = base + threadIdx.x * kItems;
    float w[kItems];
    double local = 0.0;
#pragma unroll
    for (int q = 0; q < kItems; ++q) {
      const int i = first + q;
      w[q] = 0.0f;
      if (i < vocab) {
        const float x = row[i];
        if (Key(x) >= cut) w[q] = sm.P(x);
      }
      local += static_cast<double>(w[q]);
    }
    // Block exclusive scan of `local`.
    double incl = local;
    for (int o = 1; o < 32; o <<= 1) {
      const double y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (lane == 31) sh.d[warp][0] = incl;
    __syncthreads();
    double warp_base = 0.0, tile_total = 0.0;
    for (int wi = 0; wi < kWarps; ++wi) {
      if (wi < warp) warp_base += sh.d[wi][0];
      tile_total += sh.d[wi][0];
    }
    __syncthreads();
    double run = carry + warp_base + (incl - local);
    int found = INT_MAX;
    if (carry + tile_total > target) {
#pragma unroll
      for (int q = 0; q < kItems; ++q) {
        const int i = first + q;
        if (w[q] > 0.0f) {
          run += static_cast<double>(w[q]);
          if (run > target && found == INT_MAX) found = i;
        }
      }
    }
    found = BlockMinInt(found, sh);
    if (found != INT_MAX) {
      if (threadIdx.x == 0) out[r] = found;
      return;
    }
    carry += tile_total;
  }
  if (threadIdx.x == 0) out[r] = last < 0 ? 0 : last;
}

}  // namespace

void LaunchSample(const float* logits, int rows, int vocab, const SamplingRow* params, int32_t* out,
                  cudaStream_t stream) {
  if (rows <= 0 || vocab <= 0) return;
  SampleKernel<<<rows, kThreads, 0, stream>>>(logits, vocab, params, out);
}

}  // namespace penumbra::kernels
