// KernelTrace without CUDA: nothing to trace.
#include "worker/bench/kernel_trace.h"

namespace penumbra {

Result<std::unique_ptr<KernelTrace>> KernelTrace::Start() {
  return Status::Unimplemented("--kernel-trace needs the CUDA backend (this build has none)");
}
KernelTrace::~KernelTrace() = default;
Result<std::vector<TraceRecord>> KernelTrace::Stop() { return std::vector<TraceRecord>{}; }

}  // namespace penumbra
