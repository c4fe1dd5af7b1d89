// Turning CUDA, cuBLAS and cuSOLVER errors into Status at the call site.
#pragma once

#include <string>

#include <cuda_runtime_api.h>

#include "common/status.h"

namespace penumbra::kernels {

Status CudaStatus(cudaError_t e, const char* what);

// Process-wide launch setting: whether LaunchChained (kernels/common.cuh)
// launches with programmatic dependent launch. Default on; the CUDA backend
// sets it from BackendOptions::chained_launch.
void SetChainedLaunch(bool on);
bool ChainedLaunchEnabled();

// The current device's SM count (cached per device).
int DeviceSmCount();

// True when the current device runs the sm_90a (warpgroup MMA) code this
// library was built with: compute capability 9.0 (cached per device).
bool DeviceHasWgmma();

// Raises `kernel`'s dynamic shared-memory limit to the device maximum once per
// (kernel, device) and returns the largest dynamic size a launch may ask for.
int AllowDynamicSharedMemory(const void* kernel);

}  // namespace penumbra::kernels

#define PENUMBRA_CUDA_RETURN_IF_ERROR(expr) PENUMBRA_RETURN_IF_ERROR(::penumbra::kernels::CudaStatus((expr), #expr))

// For invariants (a failing launch after validated arguments is a bug).
#define PENUMBRA_CUDA_CHECK(expr)                                        \
  do {                                                                   \
    cudaError_t _e = (expr);                                             \
    CHECK(_e == cudaSuccess) << #expr << ": " << cudaGetErrorString(_e); \
  } while (0)
