// The SpindleKV KV policy ("spindlekv"): eviction by the observation
// window's attention in a per-layer pyramid, and codebooks of similar keys
// and values (worker/engine/spindlekv_policy.cc says how).
#pragma once

#include <memory>

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

}  // namespace penumbra
