#include "worker/engine/engine.h"

namespace penumbra {

Status LoadEngineOptions(ConfigReader& r, EngineOptions* o) {
  r.ReadEnum("device", &o->backend.device, {"auto", "cpu", "cuda"});
  r.ReadEnum("dtype", &o->backend.dtype, {"auto", "bf16", "f32"});
  r.Read("cuda_device", &o->backend.cuda_device, 0, 64);
  r.Read("cpu_threads", &o->backend.cpu_threads, 0, 4096);
  r.Read("prefill_chunk", &o->runtime.prefill_chunk, 1, 1 << 20);
  r.Read("max_batch", &o->runtime.max_batch, 1, 1 << 16);
  r.ReadEnum("kv_policy", &o->kv_policy, {"full", "shadowkv"});
  ConfigReader s = r.Child("shadowkv");
  PENUMBRA_RETURN_IF_ERROR(LoadShadowKvOptions(s, &o->shadowkv));
  return r.Finish();
}

Result<EngineOptions> LoadEngineOptionsFile(const std::string& path) {
  PENUMBRA_ASSIGN_OR_RETURN(ConfigReader r, ConfigReader::FromFile(path));
  EngineOptions o;
  PENUMBRA_RETURN_IF_ERROR(LoadEngineOptions(r, &o));
  return o;
}

Result<std::unique_ptr<Engine>> Engine::Assemble(std::unique_ptr<Engine> e) {
  const ModelConfig& c = e->weights_->config();
  PENUMBRA_ASSIGN_OR_RETURN(e->policy_ctx_, MakePolicyContext(e->backend_.get(), c));
  std::unique_ptr<KvPolicy> policy;
  if (e->options_.kv_policy == "full") {
    policy = MakeFullKvPolicy(e->policy_ctx_->ctx);
  } else if (e->options_.kv_policy == "shadowkv") {
    PENUMBRA_RETURN_IF_ERROR(ValidateShadowKvOptions(e->options_.shadowkv, c.num_kv_heads, c.head_dim));
    PENUMBRA_ASSIGN_OR_RETURN(policy, MakeShadowKvPolicy(e->policy_ctx_->ctx, e->options_.shadowkv));
  } else {
    return Status::InvalidArgument("unknown kv policy '" + e->options_.kv_policy + "' (expected full or shadowkv)");
  }
  PENUMBRA_ASSIGN_OR_RETURN(e->runtime_,
                            Runtime::Create(e->options_.runtime, e->backend_.get(), e->weights_.get(), std::move(policy)));
  return e;
}

Result<std::unique_ptr<Engine>> Engine::Open(const std::string& model_dir, const EngineOptions& options) {
  auto e = std::unique_ptr<Engine>(new Engine);
  e->options_ = options;
  PENUMBRA_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(model_dir));
  PENUMBRA_RETURN_IF_ERROR(ckpt.Validate());
  PENUMBRA_ASSIGN_OR_RETURN(e->backend_, CreateBackend(options.backend));
  PENUMBRA_ASSIGN_OR_RETURN(ModelWeights w, ModelWeights::Load(ckpt, *e->backend_));
  e->weights_ = std::make_unique<ModelWeights>(std::move(w));
  return Assemble(std::move(e));
}

Result<std::unique_ptr<Engine>> Engine::OpenRandom(const ModelConfig& config, const EngineOptions& options,
                                                   uint64_t seed) {
  auto e = std::unique_ptr<Engine>(new Engine);
  e->options_ = options;
  PENUMBRA_ASSIGN_OR_RETURN(e->backend_, CreateBackend(options.backend));
  PENUMBRA_ASSIGN_OR_RETURN(ModelWeights w, ModelWeights::Random(config, *e->backend_, seed));
  e->weights_ = std::make_unique<ModelWeights>(std::move(w));
  return Assemble(std::move(e));
}

}  // namespace penumbra
