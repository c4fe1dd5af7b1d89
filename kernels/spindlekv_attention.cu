#include "kernels/spindlekv_attention.cuh"

#include <cuda_bf16.h>
#include <glog/logging.h>

#include <cmath>

#include "kernels/common.cuh"
#include "kernels/vec.cuh"

namespace penumbra::kernels {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxGroup = 8;
constexpr int kTile = 32;       // tokens a warp takes at a time: one a lane
constexpr int kValueBatch = 8;  // value rows a warp loads before adding them

// One block: row (sequence b, KV head h) = blockIdx.x, split blockIdx.y; its
// warps take tiles of 32 tokens in turn. In a tile, lanes go over tokens for
// the scores (each lane rebuilds its token's key, rotated, from the entry, and
// dots it with the group's queries from shared memory), one warp max a query
// head updates the online softmax, then lanes go over the head's E = d / 32
// elements to add each token's value (entry x magnitude) weighted by its
// probability. So a warp reduces once a tile, not once a token, and its
// tokens' metadata and keys are read by 32 loads at once.
// GM: a power of two >= the group size (registers for GM query heads).
template <typename T, int E, int GM>
__global__ void __launch_bounds__(kWarps * 32) SpindlekvAttendKernel(SpindlekvAttentionArgs a) {
  constexpr int d = E * 32, half = d / 2;
  const int row = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const int b = row / a.hkv, h = row % a.hkv, G = a.hq / a.hkv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const SpindlekvHead& head = a.heads[row];
  const int64_t n0 = head.part[0].n, total = n0 + head.part[1].n;
  const int64_t per = (total + splits - 1) / splits;
  const int64_t begin = split * per, end = begin + per < total ? begin + per : total;

  __shared__ float s_q[GM][d];  // the group's queries
  __shared__ float s_freq[half];
  __shared__ float s_p[kWarps][kTile][GM];  // a tile's probabilities
  __shared__ const T* s_v[kWarps][kTile];   // its value entries (null: no head takes the token)
  __shared__ float s_vm[kWarps][kTile];
  const T* qb = static_cast<const T*>(a.q) + (static_cast<int64_t>(b) * a.hq + static_cast<int64_t>(h) * G) * d;
  for (int idx = threadIdx.x; idx < G * d; idx += blockDim.x) s_q[idx / d][idx % d] = ToF32(qb[idx]);
  for (int idx = threadIdx.x; idx < half; idx += blockDim.x) s_freq[idx] = a.inv_freq[idx];
  __syncthreads();

  // m: the running max (the same in every lane); l: this lane's share of the
  // running sum; acc: elements lane * E .. lane * E + E - 1 of the output.
  float acc[GM][E], m[GM], l[GM];
#pragma unroll
  for (int j = 0; j < GM; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[j][e] = 0.0f;
  }

  for (int64_t i0 = begin + static_cast<int64_t>(warp) * kTile; i0 < end; i0 += kWarps * kTile) {
    // Scores: lane = token.
    const int64_t i = i0 + lane;
    uint32_t mask = 0;
    const T* ve = nullptr;
    float vm = 0.0f, sc[GM];
#pragma unroll
    for (int j = 0; j < GM; ++j) sc[j] = -INFINITY;
    if (i < end) {
      const int p = i < n0 ? 0 : 1;
      const int64_t t = p == 0 ? i : i - n0;
      const SpindlekvTokens& tk = head.part[p];
      mask = tk.heads[t];
      if (mask != 0) {
        const int32_t kr = tk.kref[t], vr = tk.vref[t];
        const T* ke =
            kr < head.key_base_entries
                ? static_cast<const T*>(head.key_entries[0]) + static_cast<int64_t>(kr) * d
                : static_cast<const T*>(head.key_entries[1]) + static_cast<int64_t>(kr - head.key_base_entries) * d;
        ve = vr < head.value_base_entries ? static_cast<const T*>(head.value_entries[0]) + static_cast<int64_t>(vr) * d
                                          : static_cast<const T*>(head.value_entries[1]) +
                                                static_cast<int64_t>(vr - head.value_base_entries) * d;
        vm = tk.vmag[t];
        const float km = tk.kmag[t], pos = static_cast<float>(tk.pos[t]);
        float dot[GM];
#pragma unroll
        for (int j = 0; j < GM; ++j) dot[j] = 0.0f;
          // Element c + u pairs with c + u + half (rotate-half); 8 of each at a time.
#pragma unroll 4
        for (int c = 0; c < half; c += 8) {
          const Pack<T, 8> plo = *reinterpret_cast<const Pack<T, 8>*>(ke + c);
          const Pack<T, 8> phi = *reinterpret_cast<const Pack<T, 8>*>(ke + c + half);
          float lo[8], hi[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            lo[u] = ToF32(plo.v[u]) * km;
            hi[u] = ToF32(phi.v[u]) * km;
          }
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            float sn, cs;
            RopeSinCos(pos * s_freq[c + u], &sn, &cs);
            const float rlo = lo[u] * cs - hi[u] * sn, rhi = hi[u] * cs + lo[u] * sn;
#pragma unroll
            for (int j = 0; j < GM; ++j) {
              if (j < G) dot[j] = fmaf(s_q[j][c + u], rlo, fmaf(s_q[j][c + half + u], rhi, dot[j]));
            }
          }
        }
#pragma unroll
        for (int j = 0; j < GM; ++j) {
          if (j < G && (mask >> j & 1u)) sc[j] = dot[j] * a.scale;
        }
      }
    }
    // The online softmax, a query head at a time over the tile.
#pragma unroll
    for (int j = 0; j < GM; ++j) {
      if (j >= G) break;
      const float tm = WarpMax(sc[j]);
      float pj = 0.0f;
      if (tm != -INFINITY) {  // the same in every lane
        const float mn = fmaxf(m[j], tm), cor = __expf(m[j] - mn);
        pj = __expf(sc[j] - mn);
        l[j] = l[j] * cor + pj;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[j][e] *= cor;
        m[j] = mn;
      }
      s_p[warp][lane][j] = pj;
    }
    s_v[warp][lane] = ve;
    s_vm[warp][lane] = vm;
    __syncwarp();
    // Values: lane = elements; eight tokens' loads issued before their sums
    // (a warp waits on gathered rows, not on arithmetic).
    const int count = end - i0 < kTile ? static_cast<int>(end - i0) : kTile;
    for (int t0 = 0; t0 < count; t0 += kValueBatch) {
      float v[kValueBatch][E];
#pragma unroll
      for (int k = 0; k < kValueBatch; ++k) {
        const int t = t0 + k;
        const T* vp = t < count ? s_v[warp][t] : nullptr;  // null: no head takes it (the same in every lane)
        const float w = vp != nullptr ? s_vm[warp][t] : 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) v[k][e] = vp != nullptr ? ToF32(vp[lane * E + e]) * w : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kValueBatch; ++k) {
        const int t = t0 + k;
        if (t >= count) break;
#pragma unroll
        for (int j = 0; j < GM; ++j) {
          if (j >= G) break;
          const float pj = s_p[warp][t][j];
#pragma unroll
          for (int e = 0; e < E; ++e) acc[j][e] = fmaf(pj, v[k][e], acc[j][e]);
        }
      }
    }
    __syncwarp();  // the tile's shared rows are read before the next tile writes them
  }
#pragma unroll
  for (int j = 0; j < GM; ++j) l[j] = WarpSum(l[j]);

  // The warps' states, merged (s_q is free now: its space is not reused, the
  // merge has its own).
  __shared__ float s_acc[kWarps][GM][d];
  __shared__ float s_ml[kWarps][GM][2];
#pragma unroll
  for (int j = 0; j < GM; ++j) {
    if (j >= G) break;
#pragma unroll
    for (int e = 0; e < E; ++e) s_acc[warp][j][lane * E + e] = acc[j][e];
    if (lane == 0) {
      s_ml[warp][j][0] = m[j];
      s_ml[warp][j][1] = l[j];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * d; idx += blockDim.x) {
    const int j = idx / d, e = idx % d;
    float M = -INFINITY;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, s_ml[w][j][0]);
    float L = 0.0f, A = 0.0f;
    if (M != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) {
        const float c = __expf(s_ml[w][j][0] - M);
        L += s_ml[w][j][1] * c;
        A += s_acc[w][j][e] * c;
      }
    }
    const int64_t qh = static_cast<int64_t>(b) * a.hq + static_cast<int64_t>(h) * G + j;
    const float o = L > 0.0f ? A / L : 0.0f;
    const float lse = L > 0.0f ? M + logf(L) : -INFINITY;
    if (splits == 1) {
      static_cast<T*>(a.out)[qh * d + e] = FromF32<T>(o);
      if (e == 0 && a.lse != nullptr) a.lse[qh] = lse;
    } else {
      float* ws = a.workspace + (qh * splits + split) * (d + 2);
      ws[e] = o;
      if (e == 0) ws[d] = lse;
    }
  }
}

// One warp per query row: the splits' normalized outputs merged by their
// log-sum-exp.
template <typename T>
__global__ void SpindlekvMergeSplitsKernel(SpindlekvAttentionArgs a) {
  const int64_t qh = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (qh >= static_cast<int64_t>(a.batch) * a.hq) return;
  const int d = a.d, splits = a.splits;
  const float* ws = a.workspace + qh * splits * (d + 2);
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, ws[s * (d + 2) + d]);
  float L = 0.0f;
  if (M != -INFINITY) {
    for (int s = 0; s < splits; ++s) L += __expf(ws[s * (d + 2) + d] - M);
  }
  for (int e = lane; e < d; e += 32) {
    float o = 0.0f;
    if (L > 0.0f) {
      for (int s = 0; s < splits; ++s) {
        const float lse = ws[s * (d + 2) + d];
        if (lse != -INFINITY) o += __expf(lse - M) * ws[s * (d + 2) + e];
      }
      o /= L;
    }
    static_cast<T*>(a.out)[qh * d + e] = FromF32<T>(o);
  }
  if (lane == 0 && a.lse != nullptr) a.lse[qh] = L > 0.0f ? M + logf(L) : -INFINITY;
}

template <typename T, int E>
void Launch(const SpindlekvAttentionArgs& a, cudaStream_t stream) {
  const dim3 grid(a.batch * a.hkv, a.splits);
  const int G = a.hq / a.hkv;
  if (G <= 1) {
    SpindlekvAttendKernel<T, E, 1><<<grid, kWarps * 32, 0, stream>>>(a);
  } else if (G <= 2) {
    SpindlekvAttendKernel<T, E, 2><<<grid, kWarps * 32, 0, stream>>>(a);
  } else if (G <= 4) {
    SpindlekvAttendKernel<T, E, 4><<<grid, kWarps * 32, 0, stream>>>(a);
  } else {
    SpindlekvAttendKernel<T, E, kMaxGroup><<<grid, kWarps * 32, 0, stream>>>(a);
  }
  if (a.splits > 1) {
    const int rows = a.batch * a.hq, per_block = 4;
    SpindlekvMergeSplitsKernel<T><<<(rows + per_block - 1) / per_block, per_block * 32, 0, stream>>>(a);
  }
}

template <typename T>
void LaunchForDim(const SpindlekvAttentionArgs& a, cudaStream_t stream) {
  switch (a.d / 32) {
    case 1:
      Launch<T, 1>(a, stream);
      break;
    case 2:
      Launch<T, 2>(a, stream);
      break;
    case 3:
      Launch<T, 3>(a, stream);
      break;
    case 4:
      Launch<T, 4>(a, stream);
      break;
    case 5:
      Launch<T, 5>(a, stream);
      break;
    case 6:
      Launch<T, 6>(a, stream);
      break;
    case 7:
      Launch<T, 7>(a, stream);
      break;
    case 8:
      Launch<T, 8>(a, stream);
      break;
    default:
      LOG(FATAL) << "spindlekv attention: head_dim " << a.d;
  }
}

}  // namespace

bool SpindlekvAttentionSupported(int hq, int hkv, int d) {
  return hkv > 0 && hq % hkv == 0 && hq / hkv <= kMaxGroup && d % 32 == 0 && d >= 32 && d <= 256;
}

void LaunchSpindlekvAttention(const SpindlekvAttentionArgs& a, cudaStream_t stream) {
  CHECK(SpindlekvAttentionSupported(a.hq, a.hkv, a.d))
      << "spindlekv attention: hq " << a.hq << " hkv " << a.hkv << " d " << a.d;
  CHECK_GE(a.splits, 1);
  CHECK(a.splits == 1 || a.workspace != nullptr) << "spindlekv attention: splits without a workspace";
  if (a.batch == 0) return;
  PENUMBRA_DISPATCH_FLOAT(a.dtype, T, LaunchForDim<T>(a, stream));
}

}  // namespace penumbra::kernels
