// KernelTrace: a device-side timeline of every kernel and copy the process
// runs while it is on (CUPTI activity records: start and end on the GPU's
// clock, stream, grid), written as JSON lines for ops/trace_summary.py.
//
// It answers what events around one kind of work cannot: where a decode step
// waits (which stream is idle, whether a fetch overlaps compute, the gaps
// between kernels). CUPTI's concurrent-kernel records do not serialize
// kernels; they add a little time per launch, so a traced run is for the
// shape of the work, not its speed (penumbra-bench --kernel-trace).
//
// Process-wide (CUPTI is): at most one trace at a time. Without CUDA, Start()
// is Unimplemented.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace penumbra {

struct TraceRecord {
  enum class Kind : uint8_t { kKernel, kMemcpy, kMemset };
  Kind kind = Kind::kKernel;
  std::string name;  // kernel: demangled function name without its arguments; copy: "HtoD", "DtoH", ...
  uint64_t start_ns = 0, end_ns = 0;  // GPU timestamps
  uint32_t stream = 0;
  uint64_t bytes = 0;    // copies and sets
  uint32_t blocks = 0;   // kernels: grid size (x * y * z)
  uint32_t threads = 0;  // kernels: block size
};

class KernelTrace {
 public:
  // Begins recording (fails if a trace is already on or CUPTI is missing).
  static Result<std::unique_ptr<KernelTrace>> Start();
  ~KernelTrace();  // stops, dropping what was not collected
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  // Stops recording (after the traced work has finished: synchronize first)
  // and returns the records sorted by start time.
  Result<std::vector<TraceRecord>> Stop();

  // Writes `records` to `path`, one JSON object per line.
  static Status Write(const std::vector<TraceRecord>& records, const std::string& path);

 private:
  KernelTrace() = default;
  bool on_ = false;
};

}  // namespace penumbra
