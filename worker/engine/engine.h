// Engine: a model, a backend, a KV policy and a runtime, assembled from
// options. What the CLI, the benchmark and (later) the worker server hold.
//
// Lanes: an engine holds one or more independent decode pipelines ("lanes")
// over ONE copy of the weights. Each lane has its own Backend (on CUDA its own
// streams, cuBLAS and cuSOLVER handles and workspaces), its own KV policy
// (sequences, caches, value store) and its own Runtime (scratch buffers). Lane
// 0 is created with the engine; AddLane adds more. Driving lanes from
// different host threads lets one lane's work (e.g. a ShadowKV value fetch
// over PCIe) overlap another's (GEMMs, attention) on the same GPU.
//
// Threading contract:
//   - Each lane is driven by at most one host thread at a time (its Runtime,
//     KvPolicy and Backend are not thread-safe). Different lanes may be driven
//     concurrently from different threads.
//   - The weights are read-only after Open/OpenRandom and shared by all lanes.
//   - Lanes share nothing else: sequence ids are per lane (the same id may
//     exist in two lanes), and a lane's device pointers (logits, KV) belong to
//     its backend's stream; reading them from another lane needs that lane's
//     Synchronize() first.
//   - AddLane, and destroying the engine, must not run concurrently with any
//     other call on the engine or its lanes. References returned by runtime(i)
//     and backend(i) stay valid until the engine is destroyed (AddLane does not
//     move existing lanes).
//   - CUDA: every lane uses options.backend.cuda_device. Kernel launches and
//     allocations go to the calling thread's current device, so a thread that
//     drives a lane on a device other than 0 must make it current first
//     (lanes' backends are created on the thread that calls AddLane).
//   - CPU: each lane's ops use all cpu_threads (OpenBLAS and ParallelFor are
//     safe to enter from several threads; N lanes oversubscribe the cores).
// Memory: each lane allocates its own runtime scratch (sized by
// max(prefill_chunk, max_batch) rows) and policy buffers.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "storage/segment_store.h"
#include "worker/engine/backend.h"
#include "worker/engine/fetch_turns.h"
#include "worker/engine/kv_policy.h"
#include "worker/engine/model_weights.h"
#include "worker/engine/runtime.h"
#include "worker/engine/shadowkv_options.h"
#include "worker/engine/specontext_head.h"
#include "worker/engine/specontext_options.h"
#include "worker/engine/spindlekv_options.h"
#include "worker/model/checkpoint.h"

namespace penumbra {

struct EngineOptions {
  BackendOptions backend;
  RuntimeOptions runtime;
  // "full", "shadowkv", "spindlekv", "specontext" or "auto" (a policy per
  // document: each sequence and document held under full or shadowkv,
  // worker/engine/per_document_policy.h). Default: full.
  std::string kv_policy = "full";
  ShadowKvOptions shadowkv;
  SpindleKvOptions spindlekv;
  SpeContextOptions specontext;
  // Tests: the CPU backend runs spindlekv with its state in device memory,
  // as CUDA does (MakeSpindleKvDevicePolicy), not the host policy. Not a
  // configuration key.
  bool spindlekv_device_state = false;
  // The persistent tier of prefix reuse (storage/segment_store.h): with a
  // path, captured prefixes are also stored on disk, and a prefix missing
  // from a lane's device cache is looked up there, so documents survive a
  // restart. Needs runtime.prefix_cache_bytes > 0. Default: no path (off).
  storage::SegmentStoreOptions prefix_store;
  // Or a persistent tier given by the caller (e.g. a value-store node's
  // client, store_node/store_node.h), shared by the lanes; not with a path.
  std::shared_ptr<storage::DocumentStore> document_store;
};

// Reads an engine YAML (keys: device, dtype, cuda_device, cpu_threads,
// linear, chained_launch, prefill_chunk, max_batch, kv_policy, shadowkv:
// {...}, spindlekv: {...}, specontext: {...}, storage: {...}); errors name
// the key.
Status LoadEngineOptions(ConfigReader& r, EngineOptions* o);
Result<EngineOptions> LoadEngineOptionsFile(const std::string& path);
// Reads the document cache's tiers (configs/storage.yaml; an engine YAML's
// `storage:`): gpu (runtime.tiers), memory, formerly dram (runtime.prefix_cache_*),
// disk (runtime.prefix_store_* and prefix_store), their keys and ranges
// declared in worker/engine/storage_options.h (storage_options.cc). Only the
// keys present change *o; errors name the key.
Status LoadStorageOptions(ConfigReader& r, EngineOptions* o);
Status LoadStorageOptionsFile(const std::string& path, EngineOptions* o);

Result<std::unique_ptr<KvPolicy>> MakeShadowKvPolicy(const PolicyContext& ctx, const ShadowKvOptions& options);

class Engine {
 public:
  // Loads and validates a Hugging Face model directory.
  static Result<std::unique_ptr<Engine>> Open(const std::string& model_dir, const EngineOptions& options);
  // A model of `config`'s shape with random weights generated on the device.
  static Result<std::unique_ptr<Engine>> OpenRandom(const ModelConfig& config, const EngineOptions& options,
                                                    uint64_t seed);

  // Destroys every lane (runtime and policy before its backend, highest lane
  // first), then the weights, then lane 0's backend, which allocated them.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Adds a lane: a new backend from options().backend on the same device and
  // dtype as lane 0, a policy of options().kv_policy and a runtime over the
  // shared weights. Returns the new lane's index. On error nothing is added.
  Result<int> AddLane();
  int lanes() const { return static_cast<int>(lanes_.size()); }
  Runtime& runtime(int lane);
  Backend& backend(int lane);

  // Lane 0.
  Runtime& runtime() { return runtime(0); }
  Backend& backend() { return *backend_; }
  const ModelConfig& config() const { return weights_->config(); }
  const ModelWeights& weights() const { return *weights_; }
  const EngineOptions& options() const { return options_; }
  // How the writes of its local prefix store fare (storage/segment_store.h);
  // all zero without one or with a remote store.
  storage::WriteHealth prefix_store_health() const;
  // Content hash of the model (config and every weight byte; "random:..."
  // for OpenRandom), computed when a persistent store is configured, else "".
  const std::string& model_identity() const { return model_identity_; }

 private:
  // One decode pipeline. Members are destroyed bottom-up: the runtime (and the
  // policy it owns) before the policy context, both before the backend.
  struct Lane {
    std::unique_ptr<Backend> owned_backend;  // null for lane 0 (backend_)
    Backend* backend = nullptr;
    std::unique_ptr<PolicyContextHolder> policy_ctx;
    std::unique_ptr<Runtime> runtime;
  };

  Engine() = default;
  static Result<std::unique_ptr<Engine>> Assemble(std::unique_ptr<Engine> e);
  // A lane over `backend` (owned when `owned` is non-null) and the weights.
  Result<std::unique_ptr<Lane>> MakeLane(std::unique_ptr<Backend> owned, Backend* backend);
  // The specontext policy of `lane`, with its retrieval head.
  Result<std::unique_ptr<KvPolicy>> MakeSpeContext(Lane& lane, Backend* backend);
  // specontext-head.safetensors in the model's directory.
  std::string DefaultSpeContextHead() const;

  EngineOptions options_;
  std::unique_ptr<Backend> backend_;  // lane 0's; the weights live in its memory
  std::unique_ptr<ModelWeights> weights_;
  std::unique_ptr<FetchTurns> fetch_turns_;               // shadowkv.fetch_turns; outlives the lanes
  std::shared_ptr<storage::DocumentStore> prefix_store_;  // shared by the lanes' runtimes; outlives them
  std::string model_identity_;
  std::string model_dir_;  // Open's; empty for OpenRandom
  std::vector<std::unique_ptr<Lane>> lanes_;
};

}  // namespace penumbra
