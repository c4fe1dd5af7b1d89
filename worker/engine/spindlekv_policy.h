// The SpindleKV KV policy ("spindlekv"): eviction by the observation
// window's attention in a per-layer pyramid, and codebooks of similar keys
// and values (worker/engine/spindlekv_policy.cc says how).
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "worker/engine/kv_policy.h"
#include "worker/engine/spindlekv_options.h"

namespace penumbra {

// Validates the options; Unimplemented on a backend it cannot run on yet
// (CUDA), naming what is missing.
Result<std::unique_ptr<KvPolicy>> MakeSpindleKvPolicy(const PolicyContext& ctx, const SpindleKvOptions& options);

// The policy with its state in device memory (worker/engine/spindlekv_device_policy.cc):
// what MakeSpindleKvPolicy makes on CUDA; on the CPU backend for tests (the
// host policy there also shares documents).
Result<std::unique_ptr<KvPolicy>> MakeSpindleKvDevicePolicy(const PolicyContext& ctx, const SpindleKvOptions& options);

namespace spindlekv {
// A decode step's check of a sequence: prefilled, and the step at the
// position after what it holds, inside its capacity.
inline Status CheckDecodePosition(int64_t seq, bool prefilled, int64_t length, int64_t capacity, int64_t position) {
  if (!prefilled) return Status::FailedPrecondition("spindlekv: sequence " + std::to_string(seq) + " is not prefilled");
  if (position != length || position >= capacity) {
    return Status::InvalidArgument("spindlekv: sequence " + std::to_string(seq) + " holds " + std::to_string(length) +
                                   " of " + std::to_string(capacity) + " tokens; a decode at position " +
                                   std::to_string(position));
  }
  return Status::OK();
}

// Why a capture of `tokens` of a sequence holding `length` is refused: a
// compressing policy captures all it holds right after a prefill ended.
inline Status CaptureNotReady(int64_t tokens, int64_t length) {
  return Status::FailedPrecondition("spindlekv captures all a sequence holds right after a prefill ended (" +
                                    std::to_string(tokens) + " tokens of " + std::to_string(length) + ")");
}
}  // namespace spindlekv

}  // namespace penumbra
