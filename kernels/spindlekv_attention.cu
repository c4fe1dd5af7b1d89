#include "kernels/spindlekv_attention.cuh"

#include <cuda_bf16.h>
#include <glog/logging.h>

#include <cmath>

#include "kernels/common.cuh"

namespace penumbra::kernels {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxGroup = 8;

// One block: row (sequence b, KV head h) = blockIdx.x, split blockIdx.y.
// E = d / 32 elements per lane.
template <typename T, int E>
__global__ void __launch_bounds__(kWarps * 32) SpindlekvAttendKernel(SpindlekvAttentionArgs a) {
  constexpr int d = E * 32, half = d / 2;
  const int row = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const int b = row / a.hkv, h = row % a.hkv, G = a.hq / a.hkv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const SpindlekvHead& head = a.heads[row];
  const int64_t n0 = head.part[0].n, total = n0 + head.part[1].n;
  const int64_t per = (total + splits - 1) / splits;
  const int64_t begin = split * per, end = begin + per < total ? begin + per : total;

  float q[kMaxGroup][E], acc[kMaxGroup][E], m[kMaxGroup], l[kMaxGroup], freq[E];
  const T* qb = static_cast<const T*>(a.q) + (static_cast<int64_t>(b) * a.hq + static_cast<int64_t>(h) * G) * d;
#pragma unroll
  for (int j = 0; j < kMaxGroup; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      q[j][e] = j < G ? ToF32(qb[static_cast<int64_t>(j) * d + lane * E + e]) : 0.0f;
      acc[j][e] = 0.0f;
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) freq[e] = a.inv_freq[(lane * E + e) % half];
  const bool first_half = lane < 16;

  for (int64_t i = begin + warp; i < end; i += kWarps) {
    const int p = i < n0 ? 0 : 1;
    const int64_t t = p == 0 ? i : i - n0;
    const SpindlekvTokens& tk = head.part[p];
    const uint32_t mask = tk.heads[t];
    if (mask == 0) continue;
    const int32_t kr = tk.kref[t], vr = tk.vref[t];
    const T* ke = kr < head.key_base_entries ? static_cast<const T*>(head.key_entries[0]) + static_cast<int64_t>(kr) * d
                                             : static_cast<const T*>(head.key_entries[1]) +
                                                   static_cast<int64_t>(kr - head.key_base_entries) * d;
    const T* ve =
        vr < head.value_base_entries
            ? static_cast<const T*>(head.value_entries[0]) + static_cast<int64_t>(vr) * d
            : static_cast<const T*>(head.value_entries[1]) + static_cast<int64_t>(vr - head.value_base_entries) * d;
    const float km = tk.kmag[t], vm = tk.vmag[t], pos = static_cast<float>(tk.pos[t]);
    float k[E], v[E], other[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      k[e] = ToF32(ke[lane * E + e]) * km;
      v[e] = ToF32(ve[lane * E + e]) * vm;
    }
#pragma unroll
    for (int e = 0; e < E; ++e) other[e] = __shfl_xor_sync(0xffffffffu, k[e], 16);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      float s, c;
      RopeSinCos(pos * freq[e], &s, &c);
      k[e] = first_half ? k[e] * c - other[e] * s : k[e] * c + other[e] * s;
    }
#pragma unroll
    for (int j = 0; j < kMaxGroup; ++j) {
      if (j >= G || !(mask >> j & 1u)) continue;  // uniform over the warp
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) dot = fmaf(q[j][e], k[e], dot);
      const float x = WarpSum(dot) * a.scale;
      const float mn = fmaxf(m[j], x);
      const float cor = __expf(m[j] - mn), w = __expf(x - mn);
      l[j] = l[j] * cor + w;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[j][e] = fmaf(acc[j][e], cor, w * v[e]);
      m[j] = mn;
    }
  }

  // The warps' states, merged.
  __shared__ float s_acc[kWarps][kMaxGroup][d];
  __shared__ float s_ml[kWarps][kMaxGroup][2];
#pragma unroll
  for (int j = 0; j < kMaxGroup; ++j) {
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
  SpindlekvAttendKernel<T, E><<<grid, kWarps * 32, 0, stream>>>(a);
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
