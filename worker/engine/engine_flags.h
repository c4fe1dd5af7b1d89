// The engine's command-line flags, shared by every program that opens an
// engine from a model directory (penumbra, penumbra-worker): --config (an
// engine YAML) first, then each flag overrides its key.
#pragma once

#include "common/args.h"
#include "common/status.h"
#include "worker/engine/engine.h"

namespace penumbra {

// --device --dtype --linear --chained-launch --config --kv-policy
// --prefill-chunk and the ShadowKV flags.
void AddEngineFlags(Args& a);
// Applies them to `o` (the YAML of --config replaces `o` first); errors name
// the flag.
Status ApplyEngineFlags(const Args& a, EngineOptions* o);

}  // namespace penumbra
