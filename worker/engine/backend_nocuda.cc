// Stubs for builds without CUDA: the CPU backend is the only one.
#include "worker/engine/backend.h"

namespace penumbra {
bool CudaBackendCompiled() { return false; }
bool CudaDevicePresent() { return false; }
Result<std::unique_ptr<Backend>> CreateCudaBackend(const BackendOptions&) {
  return Status::Unavailable("this build has no CUDA backend");
}
}  // namespace penumbra
