#include "kernels/cuda_check.h"

#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include <glog/logging.h>

namespace penumbra::kernels {

Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::OK();
  std::string msg = std::string(what) + ": " + cudaGetErrorString(e);
  if (e == cudaErrorMemoryAllocation) return Status::ResourceExhausted(msg);
  return Status::Internal(msg);
}

namespace {
std::atomic<bool> g_chained{true};
}  // namespace

void SetChainedLaunch(bool on) { g_chained.store(on, std::memory_order_relaxed); }
bool ChainedLaunchEnabled() { return g_chained.load(std::memory_order_relaxed); }

int DeviceSmCount() {
  // Asked at every skinny-linear launch: a per-thread cache, no lock (the
  // lanes' host threads launch concurrently).
  thread_local int cached_dev = -1, cached_sms = 0;
  int dev = 0;
  PENUMBRA_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev != cached_dev) {
    PENUMBRA_CUDA_CHECK(cudaDeviceGetAttribute(&cached_sms, cudaDevAttrMultiProcessorCount, dev));
    cached_dev = dev;
  }
  return cached_sms;
}

bool DeviceHasWgmma() {
  static std::atomic<int> cached[64];  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  int known = cached[dev].load(std::memory_order_relaxed);
  if (known == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    known = major == 9 && minor == 0 ? 1 : 2;
    cached[dev].store(known, std::memory_order_relaxed);
  }
  return known == 1;
}

int AllowDynamicSharedMemory(const void* kernel) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> done;  // (kernel, device) -> dynamic bytes allowed
  int dev = 0;
  PENUMBRA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = done.find({kernel, dev});
  if (it != done.end()) return it->second;
  int optin = 0;
  PENUMBRA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  cudaFuncAttributes attr{};
  PENUMBRA_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const int max_dynamic = optin - static_cast<int>(attr.sharedSizeBytes);
  PENUMBRA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_dynamic));
  done.emplace(std::make_pair(kernel, dev), max_dynamic);
  return max_dynamic;
}

}  // namespace penumbra::kernels
