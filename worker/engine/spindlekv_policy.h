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
// The prefix spec.prefix is, as the policy's own Prefix type: InvalidArgument
// when another policy made it or it leaves nothing of the prompt to prefill.
template <typename Prefix>
Result<const Prefix*> AttachedPrefix(const SequenceSpec& spec) {
  const auto* p = dynamic_cast<const Prefix*>(spec.prefix.get());
  if (p == nullptr) {
    return Status::InvalidArgument("a " + spec.prefix->policy() + " prefix cannot attach to a spindlekv sequence");
  }
  if (p->tokens() >= spec.prompt_len) {
    return Status::InvalidArgument("a prefix of " + std::to_string(p->tokens()) + " tokens leaves nothing of the " +
                                   std::to_string(spec.prompt_len) + "-token prompt to prefill");
  }
  return p;
}
}  // namespace spindlekv

}  // namespace penumbra
