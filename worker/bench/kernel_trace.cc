// KernelTrace::Write, the same with or without CUDA.
#include <fstream>

#include <nlohmann/json.hpp>

#include "worker/bench/kernel_trace.h"

namespace penumbra {

Status KernelTrace::Write(const std::vector<TraceRecord>& records, const std::string& path) {
  std::ofstream f(path, std::ios::trunc);
  if (!f) return Status::InvalidArgument("--kernel-trace: cannot open '" + path + "' for writing");
  for (const TraceRecord& r : records) {
    nlohmann::json j;
    j["kind"] = r.kind == TraceRecord::Kind::kKernel   ? "kernel"
                : r.kind == TraceRecord::Kind::kMemcpy ? "memcpy"
                                                       : "memset";
    j["name"] = r.name;
    j["start_ns"] = r.start_ns;
    j["end_ns"] = r.end_ns;
    j["stream"] = r.stream;
    if (r.kind == TraceRecord::Kind::kKernel) {
      j["blocks"] = r.blocks;
      j["threads"] = r.threads;
    } else {
      j["bytes"] = r.bytes;
    }
    f << j.dump() << '\n';
  }
  f.flush();
  if (!f) return Status::Internal("--kernel-trace: writing '" + path + "' failed");
  return Status::OK();
}

}  // namespace penumbra
