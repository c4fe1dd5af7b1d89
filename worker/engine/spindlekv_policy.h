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

}  // namespace penumbra
