#include "worker/engine/storage_options.h"

#include <glog/logging.h>

#include "storage/segment_store.h"
#include "worker/engine/engine.h"

namespace penumbra {

namespace {

constexpr size_t kMaxBytes = size_t{1} << 55;

}  // namespace

const OptionTable<TierOptions>& StorageGpuOptionTable() {
  using O = TierOptions;
  static const auto* table =
      &(*new OptionTable<O>("storage.gpu"))
           .Int(&O::gpu_capacity_bytes, "", "capacity_bytes", size_t{0}, kMaxBytes,
                "tier 0 at most; 0: off. Only device memory free beyond reserve_bytes is taken (CUDA only)")
           .Int(&O::gpu_reserve_bytes, "", "reserve_bytes", size_t{0}, kMaxBytes,
                "device memory left to sequences, scratch and workspaces")
           .Double(&O::gpu_high_watermark, "", "high_watermark", 0.01, 1.0,
                   "of the tier's size: above it the coldest copies are freed")
           .Double(&O::gpu_low_watermark, "", "low_watermark", 0.01, 1.0,
                   "... down to this fraction of the tier's size; at most high_watermark")
           .Int(&O::promote_min_reads, "", "promote_min_reads", int64_t{0}, int64_t{1} << 50,
                "heat (value chunk rows read, decayed) a document needs before it is copied")
           .Double(&O::heat_half_life_steps, "", "heat_half_life_steps", 0.001, 1e9,
                   "decode steps over which a document's heat halves")
           .Double(&O::replace_ratio, "", "replace_ratio", 1.0, 1e9,
                   "a copy gives way to a document this many times hotter (per byte)")
           .Check("low_watermark", [](const O& o) -> std::string {
             if (o.gpu_low_watermark <= o.gpu_high_watermark) return "";
             return "must be at most high_watermark (" + std::to_string(o.gpu_high_watermark) + "), got " +
                    std::to_string(o.gpu_low_watermark);
           });
  return *table;
}

const OptionTable<RuntimeOptions>& StorageMemoryOptionTable() {
  using O = RuntimeOptions;
  static const auto* table =
      &(*new OptionTable<O>("storage.memory"))
           .Int(&O::prefix_cache_bytes, "", "device_bytes", size_t{0}, kMaxBytes,
                "device bytes for cached documents' device state (low-rank keys, landmarks, exact K/V of full); "
                "0: document cache off")
           .Int(&O::prefix_cache_host_bytes, "", "host_bytes", size_t{0}, kMaxBytes,
                "host bytes for their values (shadowkv); 0: bounded by device_bytes only")
           .Double(&O::prefix_cache_low_watermark, "", "low_watermark", 0.01, 1.0,
                   "an insert that must evict evicts down to this fraction (1: only what is needed)");
  return *table;
}

const OptionTable<RuntimeOptions>& StorageDiskOptionTable() {
  using O = RuntimeOptions;
  static const auto* table =
      &(*new OptionTable<O>("storage.disk"))
           .Int(&O::prefix_store_queue_bytes, "", "queue_bytes", size_t{0}, kMaxBytes,
                "host bytes of captured documents waiting to be written (in the background); beyond it one is not "
                "stored")
           .Bool(&O::prefix_store_lazy_reads, "", "lazy_reads",
                 "a stored shadowkv document's values are read on demand (a question's chunks first), then in the "
                 "background")
           .Int(&O::prefix_store_lazy_block_bytes, "", "lazy_block_bytes", size_t{4096}, size_t{256} << 20,
                "block size of those values on disk (small: a question's chunks read alone)")
           .Int(&O::prefix_store_lazy_threads, "", "lazy_threads", 1, 256, "reads in flight for them");
  return *table;
}

std::string StorageOptionsMarkdown() {
  return StorageGpuOptionTable().Markdown() + "\n" + StorageMemoryOptionTable().Markdown() + "\n" +
         StorageDiskOptionTable().Markdown() + "\n" + storage::SegmentStoreOptionTable().Markdown();
}

Status LoadStorageOptions(ConfigReader& r, EngineOptions* o) {
  ConfigReader g = r.Child("gpu");
  PENUMBRA_RETURN_IF_ERROR(StorageGpuOptionTable().Load(g, &o->runtime.tiers));
  // `dram` is the memory section's former name, still read (with a warning)
  // so deployed configs keep working.
  if (r.Has("memory") && r.Has("dram")) {
    return r.Error("dram", "is the former name of `memory`: give one or the other");
  }
  const bool legacy = r.Has("dram");
  if (legacy) LOG(WARNING) << "storage: the `dram` section is now called `memory`; rename it";
  ConfigReader m = r.Child(legacy ? "dram" : "memory");
  PENUMBRA_RETURN_IF_ERROR(StorageMemoryOptionTable().Load(m, &o->runtime));
  // The disk section holds the worker's keys and the store's.
  ConfigReader d = r.Child("disk");
  StorageDiskOptionTable().Read(d, &o->runtime);
  PENUMBRA_RETURN_IF_ERROR(storage::LoadSegmentStoreOptions(d, &o->prefix_store));
  PENUMBRA_RETURN_IF_ERROR(StorageDiskOptionTable().Validate(o->runtime));
  return r.Finish();
}

Status LoadStorageOptionsFile(const std::string& path, EngineOptions* o) {
  PENUMBRA_ASSIGN_OR_RETURN(ConfigReader r, ConfigReader::FromFile(path));
  return LoadStorageOptions(r, o);
}

}  // namespace penumbra
