#include "worker/model/checkpoint.h"

#include <algorithm>
#include <map>

#include <nlohmann/json.hpp>

#include "common/file.h"

namespace penumbra {

using json = nlohmann::json;

namespace {

constexpr char kConfigName[] = "config.json";
constexpr char kSingleName[] = "model.safetensors";
constexpr char kIndexName[] = "model.safetensors.index.json";

bool IsFloat(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

}  // namespace

Result<Checkpoint> Checkpoint::Open(const std::string& model_dir) {
  Checkpoint ckpt;
  ckpt.dir_ = model_dir;
  PENUMBRA_ASSIGN_OR_RETURN(ckpt.config_, LoadModelConfig(JoinPath(model_dir, kConfigName)));

  const std::string single = JoinPath(model_dir, kSingleName);
  const std::string index_path = JoinPath(model_dir, kIndexName);
  if (FileExists(single)) {
    PENUMBRA_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open(single));
    ckpt.files_.push_back(std::make_unique<SafetensorsFile>(std::move(f)));
    for (const TensorInfo& t : ckpt.files_.back()->tensors()) ckpt.tensors_.emplace(t.name, &t);
    return ckpt;
  }
  if (!FileExists(index_path)) {
    return Status::NotFound(model_dir + ": neither " + kSingleName + " nor " + kIndexName + " exists");
  }

  PENUMBRA_ASSIGN_OR_RETURN(std::string text, ReadFileToString(index_path));
  json index = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object()) return Status::Corruption(index_path + ": not a JSON object");
  auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object()) {
    return Status::Corruption(index_path + ": key 'weight_map' is missing or not an object");
  }
  // Ordered so that shards are opened (and errors reported) deterministically.
  std::map<std::string, std::vector<std::string>> by_shard;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string()) {
      return Status::Corruption(index_path + ": weight_map entry for '" + it.key() + "' is not a file name");
    }
    const std::string shard = it.value().get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
      return Status::Corruption(index_path + ": weight_map entry for '" + it.key() + "' names '" + shard +
                                "', which is not a file in the model directory");
    }
    by_shard[shard].push_back(it.key());
  }
  if (by_shard.empty()) return Status::Corruption(index_path + ": weight_map is empty");
  for (const auto& [shard, names] : by_shard) {
    const std::string path = JoinPath(model_dir, shard);
    Result<SafetensorsFile> f = SafetensorsFile::Open(path);
    if (!f.ok()) {
      return f.status().WithContext(index_path + " maps tensor '" + names.front() + "' to shard " + shard);
    }
    ckpt.files_.push_back(std::make_unique<SafetensorsFile>(std::move(f).value()));
    const SafetensorsFile& file = *ckpt.files_.back();
    for (const std::string& name : names) {
      const TensorInfo* t = file.Find(name);
      if (!t) {
        return Status::Corruption(index_path + ": maps tensor '" + name + "' to " + path + ", which lacks it");
      }
      ckpt.tensors_.emplace(name, t);
    }
  }
  return ckpt;
}

std::vector<std::string> Checkpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, t] : tensors_) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

bool Checkpoint::Has(const std::string& name) const { return tensors_.count(name) != 0; }

Result<const TensorInfo*> Checkpoint::Get(const std::string& name,
                                          std::initializer_list<int64_t> expected_shape) const {
  return Get(name, std::vector<int64_t>(expected_shape));
}

Result<const TensorInfo*> Checkpoint::Get(const std::string& name, const std::vector<int64_t>& expected_shape) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return Status::NotFound(dir_ + ": checkpoint has no tensor '" + name + "'");
  const TensorInfo* t = it->second;
  if (!t->dtype_supported || !IsFloat(t->dtype)) {
    return Status::InvalidArgument(t->file + ": tensor '" + name + "' has dtype " + t->dtype_name +
                                   "; expected F32, F16 or BF16");
  }
  if (t->shape != expected_shape) {
    return Status::InvalidArgument(t->file + ": tensor '" + name + "' has shape " + ShapeToString(t->shape) +
                                   ", expected " + ShapeToString(expected_shape));
  }
  return t;
}

Status Checkpoint::Validate() const {
  const ModelConfig& c = config_;
  const int64_t h = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), inter = c.intermediate_size, v = c.vocab_size;
  std::vector<std::pair<std::string, std::vector<int64_t>>> want;
  want.push_back({"model.embed_tokens.weight", {v, h}});
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    want.push_back({p + "input_layernorm.weight", {h}});
    want.push_back({p + "self_attn.q_proj.weight", {q, h}});
    want.push_back({p + "self_attn.k_proj.weight", {kv, h}});
    want.push_back({p + "self_attn.v_proj.weight", {kv, h}});
    if (c.attention_bias) {
      want.push_back({p + "self_attn.q_proj.bias", {q}});
      want.push_back({p + "self_attn.k_proj.bias", {kv}});
      want.push_back({p + "self_attn.v_proj.bias", {kv}});
    }
    want.push_back({p + "self_attn.o_proj.weight", {h, q}});
    want.push_back({p + "post_attention_layernorm.weight", {h}});
    want.push_back({p + "mlp.gate_proj.weight", {inter, h}});
    want.push_back({p + "mlp.up_proj.weight", {inter, h}});
    want.push_back({p + "mlp.down_proj.weight", {h, inter}});
  }
  want.push_back({"model.norm.weight", {h}});
  // A tied checkpoint may still carry an lm_head copy; if so it must fit.
  if (!c.tie_word_embeddings || Has("lm_head.weight")) want.push_back({"lm_head.weight", {v, h}});
  for (const auto& [name, shape] : want) {
    Result<const TensorInfo*> t = Get(name, shape);
    if (!t.ok()) return t.status();
  }
  return Status::OK();
}

}  // namespace penumbra
