#include "kernels/cuda_check.h"

#include <atomic>

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

}  // namespace penumbra::kernels
