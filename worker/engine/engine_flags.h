// The engine's command-line flags, shared by every program that opens an
// engine from a model directory (penumbra, penumbra-worker): --config (an
// engine YAML) first, then each flag overrides its key.
#pragma once

#include "common/args.h"
#include "common/option_table.h"
#include "common/status.h"
#include "worker/engine/engine.h"

namespace penumbra {

// The engine's own options (backend, runtime, policy), declared once
// (common/option_table.h): their flags, the engine YAML's top-level keys,
// the checks and docs/operations.md's table.
const OptionTable<EngineOptions>& EngineOptionTable();

// --config, --storage-config, the table's flags and the ShadowKV flags.
void AddEngineFlags(Args& a);
// Applies them to `o` (the YAML of --config replaces `o` first); errors name
// the flag.
Status ApplyEngineFlags(const Args& a, EngineOptions* o);

}  // namespace penumbra
