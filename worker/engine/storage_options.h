// The storage YAML (configs/storage.yaml; an engine YAML's `storage:`): the
// document cache's tiers, each section's keys declared once
// (common/option_table.h) with their ranges and defaults, from which the
// reader (LoadStorageOptions, engine.h), the checks and docs/operations.md's
// tables come.
//
//   gpu:     tier 0, hot documents' values in spare device memory (runtime.tiers)
//   memory:  tier 1, documents held in this process (runtime.prefix_cache_*);
//            `dram:` is its former name, still read with a warning (both: an error)
//   disk:    tier 2, the persistent store: the worker's keys (runtime.prefix_store_*)
//            and the store's own (storage::SegmentStoreOptionTable, prefix_store)
#pragma once

#include "common/option_table.h"
#include "worker/engine/runtime.h"

namespace penumbra {

const OptionTable<TierOptions>& StorageGpuOptionTable();
const OptionTable<RuntimeOptions>& StorageMemoryOptionTable();
// The worker's keys of `disk:`; the store's are storage::SegmentStoreOptionTable()'s.
const OptionTable<RuntimeOptions>& StorageDiskOptionTable();

// The storage YAML's sections as docs/operations.md shows them: one Markdown
// table per section (`disk:` the worker's keys, then the store's).
std::string StorageOptionsMarkdown();

}  // namespace penumbra
