#include "coordinator/tenants/tenants.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include <glog/logging.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <yaml-cpp/yaml.h>

#include "common/config.h"
#include "common/crypto.h"
#include "common/file.h"

namespace penumbra::tenants {

namespace internal {

// One tenant's counters, shared by the registry's snapshots and the leases
// (which may outlive both). Guarded by `mu`.
struct TenantUsageState {
  std::mutex mu;
  int64_t sequences = 0;
  int64_t jobs = 0;
  int64_t document_bytes = 0;
  bool bucket_started = false;  // false: full at the next use
  double bucket_tokens = 0;
  double bucket_time = 0;      // clock seconds of the last refill
  double bucket_capacity = 0;  // generated_tokens_per_minute at the last refill
};

}  // namespace internal

namespace {

using Digest = std::array<unsigned char, 32>;
constexpr std::string_view kHashPrefix = "sha256:";
constexpr int64_t kMaxQuota = int64_t{1} << 53;  // exact in a double (the token bucket)
constexpr double kMaxWeight = 1e6;

Digest Sha256(std::string_view data) {
  Digest d;
  unsigned int len = 0;
  CHECK_EQ(EVP_Digest(data.data(), data.size(), d.data(), &len, EVP_sha256(), nullptr), 1)
      << "OpenSSL EVP_Digest(SHA-256) failed";
  CHECK_EQ(len, d.size());
  return d;
}

std::string Hex(const Digest& d) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * d.size());
  for (unsigned char b : d) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The digest in a "sha256:<64 hex>" string, or nullopt when it is not one.
std::optional<Digest> ParseKeyHash(const std::string& s) {
  if (s.size() != kHashPrefix.size() + 64 || s.compare(0, kHashPrefix.size(), kHashPrefix) != 0) return std::nullopt;
  Digest d;
  for (size_t i = 0; i < d.size(); ++i) {
    const int hi = HexValue(s[kHashPrefix.size() + 2 * i]), lo = HexValue(s[kHashPrefix.size() + 2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    d[i] = static_cast<unsigned char>(hi * 16 + lo);
  }
  return d;
}

// A certificate name (CN) as client_certificate may give it.
bool ValidCertificateName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
           c == '.';
  });
}

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-'; });
}

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, s < 100 ? "%.3g" : "%.0f", s);
  return buf;
}

std::string Indexed(const std::string& key, size_t i) { return key + "[" + std::to_string(i) + "]"; }

Status KeyError(const std::string& key_path, const std::string& what) {
  return Status::InvalidArgument(key_path + ": " + what);
}

// ---- parsing ------------------------------------------------------------------

// A list of strings at `key_path`; an absent node leaves *out empty. No
// element's value appears in an error (an API key list may hold a plaintext
// key by mistake).
Status ReadStringList(const YAML::Node& node, const std::string& key_path, std::vector<std::string>* out) {
  if (!node.IsDefined()) return Status::OK();
  if (!node.IsSequence()) return KeyError(key_path, "expected a list of strings");
  for (size_t i = 0; i < node.size(); ++i) {
    if (!node[i].IsScalar()) return KeyError(Indexed(key_path, i), "expected a string");
    out->push_back(node[i].Scalar());
  }
  return Status::OK();
}

void ReadQuota(ConfigReader& r, const std::string& key, std::optional<int64_t>* out) {
  if (!r.Has(key)) return;
  int64_t v = 0;
  r.Read(key, &v, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
  *out = v;  // the range is checked by ValidateTenantsConfig; a type error stays in r
}

// One element of `tenants`, read into *t. Types and unknown keys are checked
// here; values (required keys, ranges, names) by ValidateTenantsConfig.
Status ParseTenant(const YAML::Node& node, const std::string& key_path, const std::string& origin, TenantConfig* t) {
  if (!node.IsMap()) {
    return KeyError(key_path,
                    "expected a map (name, api_keys, quotas, weight, publishes_to, admin, "
                    "client_certificate)")
        .WithContext(origin);
  }
  PENUMBRA_RETURN_IF_ERROR(ReadStringList(node["api_keys"], key_path + ".api_keys", &t->api_keys).WithContext(origin));
  PENUMBRA_RETURN_IF_ERROR(
      ReadStringList(node["publishes_to"], key_path + ".publishes_to", &t->publishes_to).WithContext(origin));
  // ConfigReader reads scalars and maps; the two lists read above are left out
  // of what it sees, so that its unknown-key check covers every other key.
  YAML::Node rest(YAML::NodeType::Map);
  for (const auto& kv : node) {
    const std::string k = kv.first.as<std::string>();
    if (k != "api_keys" && k != "publishes_to") rest[kv.first] = kv.second;
  }
  ConfigReader r(rest, key_path, origin);
  r.Read("name", &t->name);
  r.Read("weight", &t->weight, -std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity());
  r.Read("admin", &t->admin);
  r.Read("client_certificate", &t->client_certificate);
  ConfigReader q = r.Child("quotas");
  ReadQuota(q, "max_concurrent_sequences", &t->quotas.max_concurrent_sequences);
  ReadQuota(q, "generated_tokens_per_minute", &t->quotas.generated_tokens_per_minute);
  ReadQuota(q, "stored_document_bytes", &t->quotas.stored_document_bytes);
  ReadQuota(q, "max_jobs_in_flight", &t->quotas.max_jobs_in_flight);
  PENUMBRA_RETURN_IF_ERROR(r.Finish());
  return q.Finish();
}

}  // namespace

// ---- configuration --------------------------------------------------------------

Result<TenantsConfig> LoadTenantsConfigFromString(const std::string& text, const std::string& origin) {
  TenantsConfig config;
  try {
    YAML::Node root;
    try {
      root = YAML::Load(text);
    } catch (const YAML::Exception& e) {
      return Status::InvalidArgument(origin + ": YAML syntax error at line " + std::to_string(e.mark.line + 1) + ": " +
                                     e.msg);
    }
    if (!root.IsMap()) return Status::InvalidArgument(origin + ": top level must be a map with the key 'tenants'");
    for (const auto& kv : root) {
      const std::string k = kv.first.as<std::string>();
      if (k != "tenants") return KeyError(k, "unknown key").WithContext(origin);
    }
    const YAML::Node list = root["tenants"];
    if (!list.IsDefined()) return KeyError("tenants", "required: a list of tenants").WithContext(origin);
    if (!list.IsSequence()) return KeyError("tenants", "expected a list of tenants").WithContext(origin);
    for (size_t i = 0; i < list.size(); ++i) {
      TenantConfig t;
      PENUMBRA_RETURN_IF_ERROR(ParseTenant(list[i], Indexed("tenants", i), origin, &t));
      config.tenants.push_back(std::move(t));
    }
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(origin + ": " + e.what());
  }
  PENUMBRA_RETURN_IF_ERROR(ValidateTenantsConfig(config).WithContext(origin));
  return config;
}

Result<TenantsConfig> LoadTenantsConfig(const std::string& path) {
  PENUMBRA_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return LoadTenantsConfigFromString(text, path);
}

Status ValidateTenantsConfig(const TenantsConfig& config) {
  if (config.tenants.empty()) return KeyError("tenants", "expected at least one tenant");
  std::map<std::string, size_t> names;
  for (size_t i = 0; i < config.tenants.size(); ++i) {
    const TenantConfig& t = config.tenants[i];
    const std::string at = Indexed("tenants", i);
    if (t.name.empty()) return KeyError(at + ".name", "required");
    if (!ValidName(t.name)) {
      return KeyError(at + ".name", "must be 1 to 64 characters of [a-z0-9_-], got '" + t.name + "'");
    }
    auto [it, added] = names.emplace(t.name, i);
    if (!added)
      return KeyError(at + ".name", "'" + t.name + "' is already the name of " + Indexed("tenants", it->second));
  }
  std::map<Digest, std::string> key_owners;  // digest -> "tenants[i].api_keys[j]"
  for (size_t i = 0; i < config.tenants.size(); ++i) {
    const TenantConfig& t = config.tenants[i];
    const std::string at = Indexed("tenants", i);
    if (t.api_keys.empty()) return KeyError(at + ".api_keys", "expected at least one key hash");
    for (size_t j = 0; j < t.api_keys.size(); ++j) {
      const std::string key_at = Indexed(at + ".api_keys", j);
      if (t.api_keys[j].compare(0, kApiKeyPlaceholder.size(), kApiKeyPlaceholder) == 0) {
        return KeyError(key_at,
                        "a placeholder of the example file: replace it with the hash of a key of your own "
                        "(`penumbra tenant new-key` prints a new key and its hash)");
      }
      // The value is never echoed: a plaintext key pasted here by mistake
      // must not reach a log.
      std::optional<Digest> d = ParseKeyHash(t.api_keys[j]);
      if (!d) {
        return KeyError(key_at, "expected 'sha256:' and 64 hex digits, the hash of a key (`penumbra tenant hash-key`)");
      }
      auto [it, added] = key_owners.emplace(*d, key_at);
      if (!added) return KeyError(key_at, "the same key hash as " + it->second);
    }
    const std::pair<const char*, const std::optional<int64_t>*> quotas[] = {
        {"max_concurrent_sequences", &t.quotas.max_concurrent_sequences},
        {"generated_tokens_per_minute", &t.quotas.generated_tokens_per_minute},
        {"stored_document_bytes", &t.quotas.stored_document_bytes},
        {"max_jobs_in_flight", &t.quotas.max_jobs_in_flight},
    };
    for (const auto& [key, value] : quotas) {
      if (!value->has_value()) continue;
      const int64_t v = **value;
      const std::string quota_at = at + ".quotas." + key;
      if (v < 1) return KeyError(quota_at, "must be >= 1, got " + std::to_string(v) + " (omit it for unlimited)");
      if (v > kMaxQuota)
        return KeyError(quota_at, "must be <= " + std::to_string(kMaxQuota) + ", got " + std::to_string(v));
    }
    if (!(t.weight > 0 && t.weight <= kMaxWeight)) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "must be > 0 and <= 1e6, got %g", t.weight);
      return KeyError(at + ".weight", buf);
    }
    if (!t.client_certificate.empty() && !ValidCertificateName(t.client_certificate)) {
      return KeyError(at + ".client_certificate",
                      "must be 1 to 64 characters of [A-Za-z0-9._-] (a client certificate's name), got '" +
                          t.client_certificate.substr(0, 64) + "'");
    }
    std::set<std::string> readers;
    for (size_t j = 0; j < t.publishes_to.size(); ++j) {
      const std::string& reader = t.publishes_to[j];
      const std::string pub_at = Indexed(at + ".publishes_to", j);
      if (!names.count(reader)) return KeyError(pub_at, "no tenant is named '" + reader + "'");
      if (reader == t.name) return KeyError(pub_at, "a tenant always reads its own corpora; list other tenants");
      if (!readers.insert(reader).second) return KeyError(pub_at, "'" + reader + "' is listed twice");
    }
  }
  return Status::OK();
}

// ---- API keys -------------------------------------------------------------------

std::string Sha256Hex(std::string_view data) { return Hex(Sha256(data)); }

Result<std::string> HashApiKey(const std::string& key) {
  if (key.size() < kMinApiKeyBytes) {
    return Status::InvalidArgument("an API key must be at least " + std::to_string(kMinApiKeyBytes) + " bytes, got " +
                                   std::to_string(key.size()));
  }
  return std::string(kHashPrefix) + Sha256Hex(key);
}

std::string NewApiKey() {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  const std::string bytes = RandomBytes(kNewApiKeyRandomBytes);
  std::string out = "pk-";
  // base64url without padding: 6 bits a character.
  uint32_t acc = 0;
  int bits = 0;
  for (unsigned char b : bytes) {
    acc = (acc << 8) | b;
    bits += 8;
    while (bits >= 6) {
      bits -= 6;
      out.push_back(kAlphabet[(acc >> bits) & 63]);
    }
  }
  if (bits > 0) out.push_back(kAlphabet[(acc << (6 - bits)) & 63]);
  return out;
}

// ---- quotas ---------------------------------------------------------------------

int32_t QuotaDecision::retry_after_ms() const {
  const double ms = std::ceil(retry_after_s * 1000.0);
  if (!(ms > 0)) return 0;
  return ms >= static_cast<double>(std::numeric_limits<int32_t>::max()) ? std::numeric_limits<int32_t>::max()
                                                                        : static_cast<int32_t>(ms);
}

namespace {

QuotaDecision Allow() { return QuotaDecision{}; }

QuotaDecision Refuse(const std::string& tenant, const std::string& what, double retry_after_s) {
  return QuotaDecision{
      Status::ResourceExhausted("tenant '" + tenant + "': " + what + "; retry after " + Seconds(retry_after_s) + " s"),
      retry_after_s};
}

QuotaDecision Deny(Status s) { return QuotaDecision{std::move(s), 0}; }

// Brings the bucket to `now`: up to `per_minute` tokens, refilled at
// per_minute / 60 a second. The caller holds u.mu.
void Refill(internal::TenantUsageState& u, int64_t per_minute, double now) {
  const double capacity = static_cast<double>(per_minute);
  u.bucket_capacity = capacity;
  if (!u.bucket_started) {
    u.bucket_started = true;
    u.bucket_tokens = capacity;
    u.bucket_time = now;
    return;
  }
  const double elapsed = std::max(0.0, now - u.bucket_time);
  u.bucket_tokens = std::min(capacity, u.bucket_tokens + elapsed * capacity / 60.0);
  u.bucket_time = std::max(u.bucket_time, now);
}

// Seconds until the bucket holds `n` tokens.
double SecondsUntilTokens(const internal::TenantUsageState& u, int64_t per_minute, double n) {
  return std::max(0.0, (n - u.bucket_tokens) * 60.0 / static_cast<double>(per_minute));
}

double SecondsUntilOneToken(const internal::TenantUsageState& u, int64_t per_minute) {
  return SecondsUntilTokens(u, per_minute, 1.0);
}

// InvalidArgument when a generation of up to `tokens` can never be admitted
// under a bucket of `per_minute`.
Status TokensNeverFit(const std::string& tenant, int64_t tokens, int64_t per_minute) {
  return Status::InvalidArgument("tenant '" + tenant + "': a generation of up to " + std::to_string(tokens) +
                                 " tokens can never fit its generated_tokens_per_minute quota of " +
                                 std::to_string(per_minute) + "; ask for at most " + std::to_string(per_minute) +
                                 " (max_new_tokens)");
}

}  // namespace

Lease::Lease(std::shared_ptr<internal::TenantUsageState> usage, Kind kind) : usage_(std::move(usage)), kind_(kind) {}

Lease::Lease(Lease&& other) noexcept : usage_(std::move(other.usage_)), kind_(other.kind_) {}

Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    usage_ = std::move(other.usage_);
    kind_ = other.kind_;
  }
  return *this;
}

Lease::~Lease() { Release(); }

TokenReservation::TokenReservation(std::shared_ptr<internal::TenantUsageState> usage, int64_t reserved)
    : usage_(std::move(usage)), reserved_(reserved) {}

TokenReservation::TokenReservation(TokenReservation&& other) noexcept
    : usage_(std::move(other.usage_)), reserved_(std::exchange(other.reserved_, 0)) {}

TokenReservation& TokenReservation::operator=(TokenReservation&& other) noexcept {
  if (this != &other) {
    Settle(0);
    usage_ = std::move(other.usage_);
    reserved_ = std::exchange(other.reserved_, 0);
  }
  return *this;
}

TokenReservation::~TokenReservation() { Settle(0); }

void TokenReservation::Settle(int64_t used) {
  if (!usage_) return;
  {
    std::lock_guard<std::mutex> lock(usage_->mu);
    // A bucket stopped meanwhile (the quota removed by a Reload) starts full
    // at its next use: nothing to give back.
    if (usage_->bucket_started) {
      const double back = static_cast<double>(reserved_) - static_cast<double>(std::max<int64_t>(used, 0));
      usage_->bucket_tokens = std::min(usage_->bucket_capacity, usage_->bucket_tokens + back);
    }
  }
  usage_.reset();
  reserved_ = 0;
}

void Lease::Release() {
  if (!usage_) return;
  {
    std::lock_guard<std::mutex> lock(usage_->mu);
    int64_t& held = kind_ == Kind::kSequence ? usage_->sequences : usage_->jobs;
    CHECK_GT(held, 0) << "a lease released twice";
    --held;
  }
  usage_.reset();
}

// ---- the registry -----------------------------------------------------------------

struct TenantRegistry::Entry {
  TenantConfig config;
  std::shared_ptr<internal::TenantUsageState> usage;
};

struct TenantRegistry::Snapshot {
  std::shared_ptr<const TenantsConfig> config;
  std::map<std::string, Entry> tenants;
  struct Key {
    Digest digest;
    std::string tenant;
  };
  std::vector<Key> keys;
};

namespace {

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

TenantRegistry::TenantRegistry(std::function<double()> clock, std::shared_ptr<const Snapshot> snapshot)
    : clock_(std::move(clock)), snapshot_(std::move(snapshot)) {}

TenantRegistry::~TenantRegistry() = default;

Result<std::unique_ptr<TenantRegistry>> TenantRegistry::Create(const TenantsConfig& config,
                                                               TenantRegistryOptions options) {
  std::function<double()> clock = options.clock ? std::move(options.clock) : std::function<double()>(SteadySeconds);
  std::unique_ptr<TenantRegistry> registry(new TenantRegistry(std::move(clock), nullptr));
  PENUMBRA_RETURN_IF_ERROR(registry->Reload(config));
  return registry;
}

std::shared_ptr<const TenantRegistry::Snapshot> TenantRegistry::Current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return snapshot_;
}

Status TenantRegistry::Reload(const TenantsConfig& config) {
  PENUMBRA_RETURN_IF_ERROR(ValidateTenantsConfig(config));
  std::lock_guard<std::mutex> reload_lock(reload_mu_);
  const std::shared_ptr<const Snapshot> old = Current();
  auto snap = std::make_shared<Snapshot>();
  snap->config = std::make_shared<const TenantsConfig>(config);
  for (const TenantConfig& t : config.tenants) {
    Entry e;
    e.config = t;
    if (old) {
      auto it = old->tenants.find(t.name);
      if (it != old->tenants.end()) e.usage = it->second.usage;
    }
    if (!e.usage) e.usage = std::make_shared<internal::TenantUsageState>();
    for (const std::string& h : t.api_keys) snap->keys.push_back({*ParseKeyHash(h), t.name});
    snap->tenants.emplace(t.name, std::move(e));
  }
  std::lock_guard<std::mutex> lock(mu_);
  snapshot_ = std::move(snap);
  return Status::OK();
}

std::shared_ptr<const TenantsConfig> TenantRegistry::config() const { return Current()->config; }

Result<const TenantRegistry::Entry*> TenantRegistry::Find(const Snapshot& snap, const std::string& tenant) {
  auto it = snap.tenants.find(tenant);
  if (it == snap.tenants.end()) return Status::PermissionDenied("tenant '" + tenant + "' is not configured");
  return &it->second;
}

Result<TenantConfig> TenantRegistry::Tenant(const std::string& tenant) const {
  const std::shared_ptr<const Snapshot> snap = Current();
  PENUMBRA_ASSIGN_OR_RETURN(const Entry* e, Find(*snap, tenant));
  return e->config;
}

Result<std::string> TenantRegistry::Authenticate(const std::string& api_key,
                                                 std::string_view client_certificate) const {
  if (api_key.empty()) return Status::PermissionDenied("no API key was given");
  const Status refused = Status::PermissionDenied(std::string(kNotAuthorized));
  if (api_key.size() > kMaxApiKeyBytes) return refused;
  const Digest presented = Sha256(api_key);
  const std::shared_ptr<const Snapshot> snap = Current();
  const std::string* tenant = nullptr;
  for (const Snapshot::Key& k : snap->keys) {
    // Every hash is compared in full: no early exit on a match or a mismatch.
    const bool match = CRYPTO_memcmp(k.digest.data(), presented.data(), presented.size()) == 0;
    if (match) tenant = &k.tenant;
  }
  if (!tenant) return refused;
  auto it = snap->tenants.find(*tenant);
  if (it == snap->tenants.end()) return refused;
  const std::string& required = it->second.config.client_certificate;
  // The same refusal as an unknown key's: a caller without the certificate
  // learns nothing about the key.
  if (!required.empty() && required != client_certificate) return refused;
  return *tenant;
}

bool TenantRegistry::CanRead(const std::string& reader, const std::string& owner) const {
  if (reader == owner) return true;
  const std::shared_ptr<const Snapshot> snap = Current();
  auto it = snap->tenants.find(owner);
  if (it == snap->tenants.end()) return false;
  const std::vector<std::string>& readers = it->second.config.publishes_to;
  return std::find(readers.begin(), readers.end(), reader) != readers.end();
}

QuotaDecision TenantRegistry::Acquire(const std::string& tenant, Lease::Kind kind, Lease* lease) {
  *lease = Lease();
  const std::shared_ptr<const Snapshot> snap = Current();
  Result<const Entry*> e = Find(*snap, tenant);
  if (!e.ok()) return Deny(e.status());
  const TenantQuotas& q = (*e)->config.quotas;
  const bool sequence = kind == Lease::Kind::kSequence;
  const std::optional<int64_t>& limit = sequence ? q.max_concurrent_sequences : q.max_jobs_in_flight;
  internal::TenantUsageState& u = *(*e)->usage;
  {
    std::lock_guard<std::mutex> lock(u.mu);
    int64_t& held = sequence ? u.sequences : u.jobs;
    if (limit && held >= *limit) {
      return Refuse(tenant,
                    std::string(sequence ? "max_concurrent_sequences" : "max_jobs_in_flight") + " of " +
                        std::to_string(*limit) + " reached",
                    kQuotaRetryAfterSeconds);
    }
    ++held;
  }
  *lease = Lease((*e)->usage, kind);
  return Allow();
}

QuotaDecision TenantRegistry::AcquireSequence(const std::string& tenant, Lease* lease) {
  return Acquire(tenant, Lease::Kind::kSequence, lease);
}

QuotaDecision TenantRegistry::AcquireJob(const std::string& tenant, Lease* lease) {
  return Acquire(tenant, Lease::Kind::kJob, lease);
}

QuotaDecision TenantRegistry::Bucket(const std::string& tenant, int64_t charge) {
  const std::shared_ptr<const Snapshot> snap = Current();
  Result<const Entry*> e = Find(*snap, tenant);
  if (!e.ok()) return Deny(e.status());
  const std::optional<int64_t>& rate = (*e)->config.quotas.generated_tokens_per_minute;
  internal::TenantUsageState& u = *(*e)->usage;
  std::lock_guard<std::mutex> lock(u.mu);
  if (!rate) {
    u.bucket_started = false;
    return Allow();
  }
  Refill(u, *rate, clock_());
  if (charge < 0) {  // a check: one token available
    if (u.bucket_tokens >= 1.0) return Allow();
    return Refuse(tenant, "generated_tokens_per_minute of " + std::to_string(*rate) + " used up",
                  SecondsUntilOneToken(u, *rate));
  }
  u.bucket_tokens -= static_cast<double>(charge);
  if (u.bucket_tokens >= 0) return Allow();
  return Refuse(tenant, "past generated_tokens_per_minute of " + std::to_string(*rate), SecondsUntilOneToken(u, *rate));
}

QuotaDecision TenantRegistry::CheckTokens(const std::string& tenant) { return Bucket(tenant, -1); }

QuotaDecision TenantRegistry::ReserveTokens(const std::string& tenant, int64_t tokens, TokenReservation* reservation) {
  *reservation = TokenReservation();
  if (tokens < 0) {
    return Deny(Status::InvalidArgument("a token reservation must be >= 0, got " + std::to_string(tokens)));
  }
  const std::shared_ptr<const Snapshot> snap = Current();
  Result<const Entry*> e = Find(*snap, tenant);
  if (!e.ok()) return Deny(e.status());
  const std::optional<int64_t>& rate = (*e)->config.quotas.generated_tokens_per_minute;
  internal::TenantUsageState& u = *(*e)->usage;
  {
    std::lock_guard<std::mutex> lock(u.mu);
    if (!rate) {
      u.bucket_started = false;
      return Allow();
    }
    if (tokens > *rate) return Deny(TokensNeverFit(tenant, tokens, *rate));
    Refill(u, *rate, clock_());
    const double want = static_cast<double>(tokens);
    if (u.bucket_tokens < want) {
      return Refuse(tenant,
                    "generated_tokens_per_minute of " + std::to_string(*rate) + ": " + std::to_string(tokens) +
                        " tokens asked (max_new_tokens), " +
                        std::to_string(static_cast<int64_t>(std::max(0.0, std::floor(u.bucket_tokens)))) + " available",
                    SecondsUntilTokens(u, *rate, want));
    }
    u.bucket_tokens -= want;
  }
  *reservation = TokenReservation((*e)->usage, tokens);
  return Allow();
}

QuotaDecision TenantRegistry::CheckTokensFit(const std::string& tenant, int64_t tokens) const {
  if (tokens < 0) {
    return Deny(Status::InvalidArgument("a token reservation must be >= 0, got " + std::to_string(tokens)));
  }
  const std::shared_ptr<const Snapshot> snap = Current();
  Result<const Entry*> e = Find(*snap, tenant);
  if (!e.ok()) return Deny(e.status());
  const std::optional<int64_t>& rate = (*e)->config.quotas.generated_tokens_per_minute;
  if (rate && tokens > *rate) return Deny(TokensNeverFit(tenant, tokens, *rate));
  return Allow();
}

QuotaDecision TenantRegistry::ChargeTokens(const std::string& tenant, int64_t n) {
  if (n < 0) return Deny(Status::InvalidArgument("a token charge must be >= 0, got " + std::to_string(n)));
  return Bucket(tenant, n);
}

QuotaDecision TenantRegistry::ReserveDocumentBytes(const std::string& tenant, int64_t bytes) {
  if (bytes < 0) return Deny(Status::InvalidArgument("document bytes must be >= 0, got " + std::to_string(bytes)));
  const std::shared_ptr<const Snapshot> snap = Current();
  Result<const Entry*> e = Find(*snap, tenant);
  if (!e.ok()) return Deny(e.status());
  const std::optional<int64_t>& limit = (*e)->config.quotas.stored_document_bytes;
  if (limit && bytes > *limit) {
    return Deny(Status::InvalidArgument("tenant '" + tenant + "': a document of " + std::to_string(bytes) +
                                        " bytes is over the whole stored_document_bytes quota of " +
                                        std::to_string(*limit)));
  }
  internal::TenantUsageState& u = *(*e)->usage;
  std::lock_guard<std::mutex> lock(u.mu);
  if (limit && bytes > *limit - u.document_bytes) {
    return Refuse(tenant,
                  "stored_document_bytes of " + std::to_string(*limit) + " would be passed (" +
                      std::to_string(u.document_bytes) + " stored, " + std::to_string(bytes) + " more asked)",
                  kQuotaRetryAfterSeconds);
  }
  u.document_bytes += bytes;
  return Allow();
}

void TenantRegistry::ReleaseDocumentBytes(const std::string& tenant, int64_t bytes) {
  CHECK_GE(bytes, 0) << "releasing a negative number of document bytes";
  const std::shared_ptr<const Snapshot> snap = Current();
  auto it = snap->tenants.find(tenant);
  if (it == snap->tenants.end()) return;
  internal::TenantUsageState& u = *it->second.usage;
  std::lock_guard<std::mutex> lock(u.mu);
  if (bytes > u.document_bytes) {
    LOG(WARNING) << "tenant '" << tenant << "': releasing " << bytes << " document bytes with only " << u.document_bytes
                 << " reserved; clamped at zero";
    u.document_bytes = 0;
    return;
  }
  u.document_bytes -= bytes;
}

Result<TenantUsage> TenantRegistry::Usage(const std::string& tenant) const {
  const std::shared_ptr<const Snapshot> snap = Current();
  PENUMBRA_ASSIGN_OR_RETURN(const Entry* e, Find(*snap, tenant));
  internal::TenantUsageState& u = *e->usage;
  std::lock_guard<std::mutex> lock(u.mu);
  TenantUsage out;
  out.sequences = u.sequences;
  out.jobs_in_flight = u.jobs;
  out.document_bytes = u.document_bytes;
  if (const std::optional<int64_t>& rate = e->config.quotas.generated_tokens_per_minute) {
    Refill(u, *rate, clock_());
    out.tokens_available = u.bucket_tokens;
  }
  return out;
}

}  // namespace penumbra::tenants
