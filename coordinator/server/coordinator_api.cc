// Who calls and what they send: authentication (API keys, tenants and their
// reloads), the model's limits the requests are validated against, and the
// text of a request tokenized.
#include "coordinator/server/coordinator.h"

#include <algorithm>
#include <map>
#include <string>

#include <yaml-cpp/yaml.h>

#include "common/crypto.h"
#include "transport/thrift_util.h"

namespace penumbra::coordinator {

Result<std::map<std::string, std::string>> LoadApiKeys(const std::string& path) {
  std::map<std::string, std::string> keys;
  try {
    YAML::Node root = YAML::LoadFile(path);
    if (!root.IsMap() || !root["keys"] || !root["keys"].IsMap()) {
      return Status::InvalidArgument(path + ": expected a map `keys: {KEY: TENANT, ...}`");
    }
    size_t i = 0;
    for (const auto& kv : root["keys"]) {
      const std::string key = kv.first.as<std::string>(), tenant = kv.second.as<std::string>();
      const std::string at = path + ": keys entry " + std::to_string(i++);
      if (tenant.empty()) return Status::InvalidArgument(at + ": the tenant is empty");
      // The key itself is never echoed.
      if (key.size() < tenants::kMinApiKeyBytes || key.size() > tenants::kMaxApiKeyBytes) {
        return Status::InvalidArgument(at + " (tenant '" + tenant + "'): a key must be " +
                                       std::to_string(tenants::kMinApiKeyBytes) + " to " +
                                       std::to_string(tenants::kMaxApiKeyBytes) + " bytes, got " +
                                       std::to_string(key.size()) + " (`penumbra tenant new-key` makes one)");
      }
      keys[key] = tenant;
    }
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(path + ": " + e.what());
  }
  if (keys.empty()) return Status::InvalidArgument(path + ": no keys");
  return keys;
}

Result<std::string> Coordinator::Tenant(const std::string& api_key) const {
  // The caller's client certificate, when it presented a verified one of role
  // client (a tenant may require it).
  const transport::PeerIdentity& peer = transport::CurrentPeer();
  const std::string cert = peer.verified && peer.role == transport::role::kClient ? peer.name : std::string();
  if (o_.tenants) return o_.tenants->Authenticate(api_key, cert);
  if (o_.api_keys.empty()) return std::string("default");
  std::shared_ptr<const std::map<std::string, std::string>> keys;
  {
    std::lock_guard<std::mutex> lk(api_keys_mu_);
    keys = api_keys_;
  }
  // Every key is compared (in constant time), so the time taken does not
  // tell which matched.
  const std::string* tenant = nullptr;
  if (api_key.size() <= tenants::kMaxApiKeyBytes) {
    for (const auto& [key, t] : *keys) {
      if (ConstantTimeEquals(key, api_key)) tenant = &t;
    }
  }
  if (!tenant) return Status::PermissionDenied(std::string(tenants::TenantRegistry::kNotAuthorized));
  return *tenant;
}

Status Coordinator::Authenticate(const std::string& api_key) const { return Tenant(api_key).status(); }

bool Coordinator::SeesInternals(const std::string& tenant) const {
  if (o_.tenants) {
    Result<tenants::TenantConfig> t = o_.tenants->Tenant(tenant);
    return t.ok() && t->admin;
  }
  return o_.api_keys.empty();  // no authentication: a development setup
}

Status Coordinator::ReloadTenants(const tenants::TenantsConfig& config) {
  if (!o_.tenants) return Status::FailedPrecondition("the coordinator was started without tenants");
  return o_.tenants->Reload(config);
}

Status Coordinator::ReloadApiKeys(std::map<std::string, std::string> keys) {
  if (o_.api_keys.empty()) return Status::FailedPrecondition("the coordinator was started without API keys");
  if (keys.empty()) return Status::InvalidArgument("no API keys");
  CoordinatorOptions check;
  check.api_keys = keys;
  PENUMBRA_RETURN_IF_ERROR(check.Validate());
  auto fresh = std::make_shared<const std::map<std::string, std::string>>(std::move(keys));
  std::lock_guard<std::mutex> lk(api_keys_mu_);
  api_keys_ = std::move(fresh);
  return Status::OK();
}

ModelLimits Coordinator::model_limits() const {
  ModelLimits m;
  for (const WorkerState& w : workers_->states()) {
    m.vocab_size = std::max(m.vocab_size, w.health.vocab_size);
    if (w.healthy) m.max_context = std::max(m.max_context, w.health.max_context);
  }
  m.can_encode = codec_ && codec_->can_encode();
  m.can_decode = codec_ != nullptr;
  return m;
}

Result<std::vector<int32_t>> Coordinator::TextOrIds(const std::string& what, const std::string* text,
                                                    const std::vector<int32_t>* ids, bool starts_prompt,
                                                    const ModelLimits& model) const {
  if (!text) return *ids;  // validated: count and vocabulary
  if (!codec_ || !codec_->can_encode()) {
    return Status::InvalidArgument(what + ": the coordinator has no tokenizer for this model; send token_ids");
  }
  // The tokenizer's template (a BOS) only where the prompt starts.
  PENUMBRA_ASSIGN_OR_RETURN(std::vector<int32_t> out, codec_->Encode(*text, starts_prompt));
  if (out.empty()) return Status::InvalidArgument(what + " is empty");
  for (int32_t id : out) {
    if (id < 0 || (model.vocab_size > 0 && id >= model.vocab_size)) {
      return Status::InvalidArgument(what + ": the tokenizer gave id " + std::to_string(id) +
                                     ", outside the workers' vocabulary [0, " + std::to_string(model.vocab_size) + ")");
    }
  }
  return out;
}

}  // namespace penumbra::coordinator
