// Shared device helpers for kernels: bf16/f32 load/store, warp reductions.
// Header-only; included by .cu files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda_check.h"

namespace penumbra::kernels {

template <typename T>
__device__ __forceinline__ float ToF32(T x);
template <>
__device__ __forceinline__ float ToF32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float ToF32<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float ToF32<__half>(__half x) {
  return __half2float(x);
}

template <typename T>
__device__ __forceinline__ T FromF32(float x);
template <>
__device__ __forceinline__ float FromF32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF32<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <>
__device__ __forceinline__ __half FromF32<__half>(float x) {
  return __float2half(x);
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// sin and cos of RoPE's f32 angle x (f32(position) * inv_freq, as HF computes
// it) for keys rebuilt at decode (ShadowKV's RebuildK, SpindleKV's attention). sincosf reduces an argument past
// 105615 (the lowest frequency, past ~105K positions) by Payne-Hanek in local
// memory, one lane at a time; traced at 124928 x 64 that made this kernel
// bound by RoPE (~1,500 instructions per warp per tile against 80 MMAs).
// Here x is reduced by 2π in f32 with two FMAs (Cody-Waite): k = rint(x /
// 2π); r1 = x - k·C1 with C1 = f32(2π) is exact for angles below 2^24 (the
// FMA forms k·C1 exactly, and the difference, under 4 in magnitude, is a
// multiple of 2^-21, so it fits a float); r = r1 - k·C2 with C2 = f32(2π - C1) rounds once (<= 2.4e-7)
// and leaves out k·(2π - C1 - C2) (< 1e-14 a unit of k). r goes to the fast
// sin/cos (absolute error <= 2^-21.4 on [-π, π]): under 1e-6 in all, far
// below the bf16 ulp of the rotated key. (A reduction in double did the same
// with three conversions an angle, which the FP64/conversion pipe serialized.)
__device__ __forceinline__ void RopeSinCos(float x, float* s, float* c) {
  constexpr float kInv2Pi = 0.15915494309189535f;
  constexpr float kC1 = 6.28318548202514648f;      // f32(2π)
  constexpr float kC2 = -1.74845553146951365e-7f;  // f32(2π - C1)
  const float k = rintf(x * kInv2Pi);
  const float r = fmaf(-k, kC2, fmaf(-k, kC1, x));
  __sincosf(r, s, c);
}

// ---- chained launches (programmatic dependent launch, sm_90+) -----------------
// A kernel launched with LaunchChained may be scheduled while the kernel before
// it in the stream is still running: it calls ChainWait() before touching any
// memory an earlier kernel writes or reads, then ChainRelease() so the next
// chained kernel can be scheduled in turn (its blocks then wait, resident, in
// their own ChainWait). Decode runs ~20 dependent kernels per layer and
// sequence group; chaining hides the launch gap between them. Both device
// calls are no-ops in a kernel launched the ordinary way.
__device__ __forceinline__ void ChainWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void ChainRelease() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <typename... KArgs, typename... Args>
void LaunchChained(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args... args) {
  if (!ChainedLaunchEnabled()) {
    kernel<<<grid, block, smem, stream>>>(static_cast<KArgs>(args)...);
    return;
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  (void)cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);  // errors: cudaGetLastError
}

}  // namespace penumbra::kernels

// Dispatches on a runtime DType to a C++ element type named `T` (f32/bf16/f16).
#define PENUMBRA_DISPATCH_FLOAT(dtype, T, ...) \
  switch (dtype) {                             \
    case ::penumbra::DType::kF32: {            \
      using T = float;                         \
      __VA_ARGS__;                             \
      break;                                   \
    }                                          \
    case ::penumbra::DType::kBF16: {           \
      using T = __nv_bfloat16;                 \
      __VA_ARGS__;                             \
      break;                                   \
    }                                          \
    case ::penumbra::DType::kF16: {            \
      using T = __half;                        \
      __VA_ARGS__;                             \
      break;                                   \
    }                                          \
    default:                                   \
      break;                                   \
  }
