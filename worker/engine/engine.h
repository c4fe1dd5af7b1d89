// Engine: a model, a backend, a KV policy and a runtime, assembled from
// options. What the CLI, the benchmark and (later) the worker server hold.
#pragma once

#include <memory>
#include <string>

#include "common/config.h"
#include "common/status.h"
#include "worker/engine/backend.h"
#include "worker/engine/kv_policy.h"
#include "worker/engine/model_weights.h"
#include "worker/engine/runtime.h"
#include "worker/engine/shadowkv_options.h"
#include "worker/model/checkpoint.h"

namespace penumbra {

struct EngineOptions {
  BackendOptions backend;
  RuntimeOptions runtime;
  std::string kv_policy = "full";  // "full" or "shadowkv". Default: full.
  ShadowKvOptions shadowkv;
};

// Reads an engine YAML (keys: device, dtype, cuda_device, cpu_threads,
// prefill_chunk, max_batch, kv_policy, shadowkv: {...}); errors name the key.
Status LoadEngineOptions(ConfigReader& r, EngineOptions* o);
Result<EngineOptions> LoadEngineOptionsFile(const std::string& path);

Result<std::unique_ptr<KvPolicy>> MakeShadowKvPolicy(const PolicyContext& ctx, const ShadowKvOptions& options);

class Engine {
 public:
  // Loads and validates a Hugging Face model directory.
  static Result<std::unique_ptr<Engine>> Open(const std::string& model_dir, const EngineOptions& options);
  // A model of `config`'s shape with random weights generated on the device.
  static Result<std::unique_ptr<Engine>> OpenRandom(const ModelConfig& config, const EngineOptions& options,
                                                    uint64_t seed);

  Runtime& runtime() { return *runtime_; }
  Backend& backend() { return *backend_; }
  const ModelConfig& config() const { return weights_->config(); }
  const ModelWeights& weights() const { return *weights_; }
  const EngineOptions& options() const { return options_; }

 private:
  static Result<std::unique_ptr<Engine>> Assemble(std::unique_ptr<Engine> e);
  EngineOptions options_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<ModelWeights> weights_;
  std::unique_ptr<PolicyContextHolder> policy_ctx_;
  std::unique_ptr<Runtime> runtime_;
};

}  // namespace penumbra
