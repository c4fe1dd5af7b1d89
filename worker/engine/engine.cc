#include "worker/engine/engine.h"

#include <glog/logging.h>

#include "common/file.h"
#include "common/hash.h"
#include "worker/engine/engine_flags.h"
#include "worker/engine/per_document_policy.h"
#include "worker/engine/specontext_policy.h"
#include "worker/engine/spindlekv_policy.h"

namespace penumbra {

Status LoadEngineOptions(ConfigReader& r, EngineOptions* o) {
  EngineOptionTable().Read(r, o);
  ConfigReader s = r.Child("shadowkv");
  PENUMBRA_RETURN_IF_ERROR(LoadShadowKvOptions(s, &o->shadowkv));
  ConfigReader sp = r.Child("spindlekv");
  PENUMBRA_RETURN_IF_ERROR(LoadSpindleKvOptions(sp, &o->spindlekv));
  ConfigReader sc = r.Child("specontext");
  PENUMBRA_RETURN_IF_ERROR(LoadSpeContextOptions(sc, &o->specontext));
  ConfigReader st = r.Child("storage");
  PENUMBRA_RETURN_IF_ERROR(LoadStorageOptions(st, o));
  PENUMBRA_RETURN_IF_ERROR(r.Finish());
  return EngineOptionTable().Validate(*o);
}

Result<EngineOptions> LoadEngineOptionsFile(const std::string& path) {
  PENUMBRA_ASSIGN_OR_RETURN(ConfigReader r, ConfigReader::FromFile(path));
  EngineOptions o;
  PENUMBRA_RETURN_IF_ERROR(LoadEngineOptions(r, &o));
  return o;
}

Engine::~Engine() {
  // Highest lane first; each lane's runtime and policy before its backend
  // (Lane's member order). Pending work is drained so no kernel still reads a
  // buffer being freed.
  while (!lanes_.empty()) {
    (void)lanes_.back()->backend->Synchronize();
    lanes_.pop_back();
  }
  weights_.reset();
  backend_.reset();
}

Result<std::unique_ptr<Engine::Lane>> Engine::MakeLane(std::unique_ptr<Backend> owned, Backend* backend) {
  auto lane = std::make_unique<Lane>();
  lane->owned_backend = std::move(owned);
  lane->backend = backend;
  const ModelConfig& c = weights_->config();
  PENUMBRA_ASSIGN_OR_RETURN(lane->policy_ctx, MakePolicyContext(backend, c));
  if (fetch_turns_) {
    PENUMBRA_RETURN_IF_ERROR(backend->PrepareFetchTurns(c.num_layers));
    lane->policy_ctx->ctx.fetch_turns = fetch_turns_.get();
    lane->policy_ctx->ctx.lane = lanes();  // registered once the lane is built
  }
  std::unique_ptr<KvPolicy> policy;
  if (options_.kv_policy == "full") {
    policy = MakeFullKvPolicy(lane->policy_ctx->ctx);
  } else if (options_.kv_policy == "shadowkv") {
    // Validates the options against the model and the device first.
    PENUMBRA_ASSIGN_OR_RETURN(policy, MakeShadowKvPolicy(lane->policy_ctx->ctx, options_.shadowkv));
  } else if (options_.kv_policy == "spindlekv") {
    PENUMBRA_ASSIGN_OR_RETURN(policy, options_.spindlekv_device_state
                                          ? MakeSpindleKvDevicePolicy(lane->policy_ctx->ctx, options_.spindlekv)
                                          : MakeSpindleKvPolicy(lane->policy_ctx->ctx, options_.spindlekv));
  } else if (options_.kv_policy == "specontext") {
    PENUMBRA_ASSIGN_OR_RETURN(policy, MakeSpeContext(*lane, backend));
  } else if (options_.kv_policy == "auto") {
    PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<KvPolicy> sparse,
                              MakeShadowKvPolicy(lane->policy_ctx->ctx, options_.shadowkv));
    // spindlekv and, where the model has a retrieval head (specontext.head,
    // or one in its directory), specontext as further forms held by pins
    // only.
    std::vector<std::unique_ptr<KvPolicy>> pinned;
    PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<KvPolicy> spindle,
                              MakeSpindleKvPolicy(lane->policy_ctx->ctx, options_.spindlekv));
    pinned.push_back(std::move(spindle));
    if (!options_.specontext.head.empty() || model_dir_.empty() || FileExists(DefaultSpeContextHead())) {
      PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<KvPolicy> spe, MakeSpeContext(*lane, backend));
      pinned.push_back(std::move(spe));
    }
    const RuntimeOptions& r = options_.runtime;
    policy = MakePerDocumentKvPolicy(lane->policy_ctx->ctx, MakeFullKvPolicy(lane->policy_ctx->ctx), std::move(sparse),
                                     r.auto_exact_bytes > 0 ? r.auto_exact_bytes : r.prefix_cache_bytes / 2,
                                     std::move(pinned));
  } else {
    return Status::InvalidArgument("unknown kv policy '" + options_.kv_policy +
                                   "' (expected full, shadowkv, spindlekv, specontext or auto)");
  }
  PENUMBRA_ASSIGN_OR_RETURN(
      lane->runtime, Runtime::Create(options_.runtime, lane->policy_ctx->ctx, weights_.get(), std::move(policy)));
  if (prefix_store_) lane->runtime->SetPrefixStore(prefix_store_.get(), model_identity_);
  return lane;
}

std::string Engine::DefaultSpeContextHead() const { return JoinPath(model_dir_, "specontext-head.safetensors"); }

// The specontext policy of a lane, with its retrieval head: specontext.head
// (a file or "random"), else the model directory's, else (a random model) a
// random one.
Result<std::unique_ptr<KvPolicy>> Engine::MakeSpeContext(Lane& lane, Backend* backend) {
  const SpeContextOptions& so = options_.specontext;
  const TargetEmbedding embed{weights_->embed(), weights_->dtype()};
  std::string path = so.head;
  if (path.empty()) path = model_dir_.empty() ? "random" : DefaultSpeContextHead();
  const ModelConfig& c = weights_->config();
  Result<std::unique_ptr<SpeContextHead>> head =
      path == "random" ? SpeContextHead::Random(c, embed, backend, /*seed=*/0x5eC0, so.yarn_factor)
                       : SpeContextHead::Load(path, c, embed, backend, so.yarn_factor);
  PENUMBRA_RETURN_IF_ERROR(head.status());
  return MakeSpeContextPolicy(lane.policy_ctx->ctx, so, std::move(*head));
}

Result<std::unique_ptr<Engine>> Engine::Assemble(std::unique_ptr<Engine> e) {
  if (e->options_.document_store && !e->options_.prefix_store.path.empty()) {
    return Status::InvalidArgument("a document store is given and storage.disk.path is set: one or the other");
  }
  if (e->options_.document_store || !e->options_.prefix_store.path.empty()) {
    if (e->options_.runtime.prefix_cache_bytes == 0) {
      return Status::InvalidArgument(
          "a persistent document store needs storage.memory.device_bytes > 0 (the memory "
          "tier in front of it)");
    }
  }
  if (e->options_.document_store) {
    e->prefix_store_ = e->options_.document_store;
  } else if (!e->options_.prefix_store.path.empty()) {
    PENUMBRA_ASSIGN_OR_RETURN(e->prefix_store_, storage::SegmentStore::Open(e->options_.prefix_store));
  }
  if ((e->options_.kv_policy == "shadowkv" || e->options_.kv_policy == "auto") && e->options_.shadowkv.fetch_turns) {
    e->fetch_turns_ = std::make_unique<FetchTurns>();
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<Lane> lane, e->MakeLane(nullptr, e->backend_.get()));
  e->lanes_.push_back(std::move(lane));
  if (e->fetch_turns_) CHECK_EQ(e->fetch_turns_->AddLane(e->backend_.get()), 0);
  return e;
}

Result<int> Engine::AddLane() {
  PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<Backend> b, CreateBackend(options_.backend));
  // The weights are in lane 0's memory: a lane must compute on the same kind
  // of device in the same dtype to read them.
  if (b->device() != backend_->device() || b->act_dtype() != backend_->act_dtype()) {
    return Status::Internal("AddLane: the new backend (" + b->name() + ", " + std::string(DTypeName(b->act_dtype())) +
                            ") differs from lane 0's (" + backend_->name() + ", " +
                            std::string(DTypeName(backend_->act_dtype())) + ")");
  }
  Backend* raw = b.get();
  PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<Lane> lane, MakeLane(std::move(b), raw));
  lanes_.push_back(std::move(lane));
  if (fetch_turns_) CHECK_EQ(fetch_turns_->AddLane(raw), lanes() - 1);
  return lanes() - 1;
}

Runtime& Engine::runtime(int lane) {
  CHECK(lane >= 0 && lane < lanes()) << "lane " << lane << " of " << lanes();
  return *lanes_[lane]->runtime;
}

Backend& Engine::backend(int lane) {
  CHECK(lane >= 0 && lane < lanes()) << "lane " << lane << " of " << lanes();
  return *lanes_[lane]->backend;
}

Result<std::unique_ptr<Engine>> Engine::Open(const std::string& model_dir, const EngineOptions& options) {
  auto e = std::unique_ptr<Engine>(new Engine);
  e->options_ = options;
  e->model_dir_ = model_dir;
  PENUMBRA_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(model_dir));
  PENUMBRA_RETURN_IF_ERROR(ckpt.Validate());
  PENUMBRA_ASSIGN_OR_RETURN(e->backend_, CreateBackend(options.backend));
  PENUMBRA_ASSIGN_OR_RETURN(ModelWeights w, ModelWeights::Load(ckpt, *e->backend_));
  e->weights_ = std::make_unique<ModelWeights>(std::move(w));
  if (!options.prefix_store.path.empty() || options.document_store) {
    // Every byte of config.json and of every tensor (files and tensors in
    // their stored order): a stored prefix is never attached to another
    // model, however alike in shape. Reads the whole checkpoint once.
    Hasher128 h;
    PENUMBRA_ASSIGN_OR_RETURN(std::string config, ReadFileToString(JoinPath(model_dir, "config.json")));
    h.Update(config);
    for (const auto& file : ckpt.files()) {
      for (const TensorInfo& t : file->tensors()) {
        h.Update(t.name).Update(t.dtype_name).Update(t.shape.data(), t.shape.size() * sizeof(int64_t));
        h.Update(t.data, t.bytes);
      }
    }
    e->model_identity_ = "checkpoint:" + h.Digest().Hex();
  }
  return Assemble(std::move(e));
}

Result<std::unique_ptr<Engine>> Engine::OpenRandom(const ModelConfig& config, const EngineOptions& options,
                                                   uint64_t seed) {
  auto e = std::unique_ptr<Engine>(new Engine);
  e->options_ = options;
  PENUMBRA_ASSIGN_OR_RETURN(e->backend_, CreateBackend(options.backend));
  PENUMBRA_ASSIGN_OR_RETURN(ModelWeights w, ModelWeights::Random(config, *e->backend_, seed));
  e->weights_ = std::make_unique<ModelWeights>(std::move(w));
  if (!options.prefix_store.path.empty() || options.document_store) {
    e->model_identity_ = "random:" + std::to_string(seed) + ":" + std::to_string(config.num_layers) + "x" +
                         std::to_string(config.hidden_size) + "x" + std::to_string(config.vocab_size);
  }
  return Assemble(std::move(e));
}

storage::WriteHealth Engine::prefix_store_health() const {
  const auto* local = dynamic_cast<const storage::SegmentStore*>(prefix_store_.get());
  return local ? local->write_health() : storage::WriteHealth{};
}

}  // namespace penumbra
