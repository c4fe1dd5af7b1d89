// The NCCL data plane's place in builds without it (CPU-only, or CUDA
// without libnccl): CUDA backends' groups are Unimplemented.
#include "worker/parallel/process_group.h"

namespace penumbra {

bool NcclCollectiveCompiled() { return false; }

Result<std::unique_ptr<Collective>> ConnectNcclCollective(Backend* backend, std::unique_ptr<Collective> control,
                                                          double timeout_s) {
  (void)backend;
  (void)control;
  (void)timeout_s;
  return Status::Unimplemented("collective: this build has no NCCL (a CUDA backend's group needs it)");
}

}  // namespace penumbra
