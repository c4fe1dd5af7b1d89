// Tenants: who may call the service (API keys, stored hashed), what each may
// read (its own namespace and corpora published to it), and how much each may
// use at once (quotas).
//
// The configuration (configs/tenants.yaml) is a list of tenants; every key is
// validated on load and an error names the key path, e.g.
// "tenants[1].quotas.generated_tokens_per_minute: must be >= 1, got 0".
// TenantRegistry holds the current configuration and every tenant's live
// usage; Reload swaps the configuration (SIGHUP) and keeps the usage of the
// tenants that remain.
//
// Quota refusals are ResourceExhausted. Status has no room for a retry-after,
// so quota calls return a QuotaDecision: the Status plus retry_after_s.
//
// Generated tokens are reserved before a generation runs (ReserveTokens: its
// most possible tokens) and the unused part is given back when it ends
// (TokenReservation::Settle), so a tenant never generates more than its
// bucket holds.
//
// This header pulls in no crypto library: SHA-256 comes from OpenSSL's
// libcrypto, used only in tenants.cc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace penumbra::tenants {

// ---- configuration ----------------------------------------------------------

// Per-tenant limits. Each is optional; absent means unlimited.
struct TenantQuotas {
  // Sequences generating at once (AcquireSequence). Default: unlimited.
  std::optional<int64_t> max_concurrent_sequences;
  // Generated tokens per minute: a token bucket holding up to this many,
  // refilled continuously at this rate. Default: unlimited.
  std::optional<int64_t> generated_tokens_per_minute;
  // Bytes of stored documents (ReserveDocumentBytes). Default: unlimited.
  std::optional<int64_t> stored_document_bytes;
  // Batch jobs submitted and not yet finished (AcquireJob). Default: unlimited.
  std::optional<int64_t> max_jobs_in_flight;
};

struct TenantConfig {
  // The tenant's namespace: 1 to 64 of [a-z0-9_-]. Default: none (required).
  std::string name;
  // Hashes of the tenant's API keys, each "sha256:<64 hex digits>" as
  // HashApiKey returns; several allow rotation. Default: none (at least one).
  std::vector<std::string> api_keys;
  // Limits on what the tenant may use. Default: all unlimited.
  TenantQuotas quotas;
  // Fair-share weight under load: a tenant of weight 2 is served twice as
  // often as one of weight 1 while both wait. In (0, 1e6]. Default: 1.
  double weight = 1.0;
  // Tenants that may read this tenant's published corpora. Default: none.
  std::vector<std::string> publishes_to;
  // Sees the service's internals (the workers' names, addresses, health and
  // load in Stats). Default: false.
  bool admin = false;
  // Non-empty: the tenant's keys are accepted only on a TLS connection whose
  // verified client certificate (role client) has this name (CN); 1 to 64
  // characters of [A-Za-z0-9._-]. Default: "" (any connection).
  std::string client_certificate;
};

struct TenantsConfig {
  // Every tenant, names and key hashes unique. Default: none (at least one).
  std::vector<TenantConfig> tenants;
};

// Parses and validates configs/tenants.yaml-style YAML. Unknown keys, wrong
// types, bad values, a repeated tenant name and a key hash given twice are
// InvalidArgument naming the origin and the key path. An API key entry that is
// not a hash is refused without echoing it (it may be a plaintext key); the
// example file's placeholders (kApiKeyPlaceholder) are refused with an error
// saying to replace them.
Result<TenantsConfig> LoadTenantsConfig(const std::string& path);
Result<TenantsConfig> LoadTenantsConfigFromString(const std::string& text, const std::string& origin = "<string>");

// The checks LoadTenantsConfig makes, for a configuration built in code.
// Errors name the key path ("tenants[0].weight: ...").
Status ValidateTenantsConfig(const TenantsConfig& config);

// ---- API keys -----------------------------------------------------------------

// Keys shorter than this are refused by HashApiKey (and by the coordinator's
// plain --api-keys).
inline constexpr size_t kMinApiKeyBytes = 16;
// A presented key longer than this is not valid (refused before hashing).
inline constexpr size_t kMaxApiKeyBytes = 4096;
// What configs/tenants.yaml ships in place of key hashes: an entry starting
// with this is refused at load (replace it: `penumbra tenant new-key`).
inline constexpr std::string_view kApiKeyPlaceholder = "sha256:REPLACE";
// Random bytes of a key made by NewApiKey.
inline constexpr size_t kNewApiKeyRandomBytes = 32;

// SHA-256 of `data` as 64 lowercase hex digits.
std::string Sha256Hex(std::string_view data);

// The config form of an API key, "sha256:<64 hex>" (the CLI's
// `penumbra tenant hash-key`). InvalidArgument for a key shorter than
// kMinApiKeyBytes; the message never contains the key.
Result<std::string> HashApiKey(const std::string& key);

// A fresh API key: kNewApiKeyRandomBytes from the CSPRNG, base64url without
// padding (43 characters of [A-Za-z0-9_-]), prefixed "pk-".
std::string NewApiKey();

// ---- quotas -------------------------------------------------------------------

// The retry-after given when a concurrency or storage quota is full: the time
// until a lease or bytes free up is unknown, so this is a hint.
inline constexpr double kQuotaRetryAfterSeconds = 1.0;

// The outcome of a quota call. `status` is OK, ResourceExhausted (a quota is
// full: retry after retry_after_s), PermissionDenied (the tenant is not
// configured) or InvalidArgument (a bad amount).
struct [[nodiscard]] QuotaDecision {
  Status status;
  // Seconds until the same call may succeed; > 0 only with ResourceExhausted.
  double retry_after_s = 0;

  bool ok() const { return status.ok(); }
  // retry_after_s rounded up, for ToRpcError's retry_after_ms.
  int32_t retry_after_ms() const;
};

namespace internal {
struct TenantUsageState;
}  // namespace internal

// A held unit of a concurrency quota (one sequence, one job). Move-only;
// gives the unit back on destruction or Release(). Safe to keep past a Reload
// that changes or removes its tenant, and past the registry itself. One
// owner at a time; different leases may be released from any threads.
class Lease {
 public:
  Lease() = default;
  Lease(Lease&& other) noexcept;
  Lease& operator=(Lease&& other) noexcept;  // releases what this held first
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease();

  // Gives the unit back now; no-op when none is held.
  void Release();
  bool held() const { return usage_ != nullptr; }

 private:
  friend class TenantRegistry;
  enum class Kind : uint8_t { kSequence, kJob };
  Lease(std::shared_ptr<internal::TenantUsageState> usage, Kind kind);

  std::shared_ptr<internal::TenantUsageState> usage_;
  Kind kind_ = Kind::kSequence;
};

// Generated tokens taken from a tenant's generated_tokens_per_minute bucket
// before a generation runs (TenantRegistry::ReserveTokens). Move-only.
// Settle(used) keeps `used` of them and gives the rest back to the bucket
// (never above its capacity); destroyed unsettled, it gives all of them back
// (the generation never ran). Empty (reserved() 0) for a tenant without that
// quota. Safe past a Reload and past the registry, as Lease; one owner at a
// time.
class TokenReservation {
 public:
  TokenReservation() = default;
  TokenReservation(TokenReservation&& other) noexcept;
  TokenReservation& operator=(TokenReservation&& other) noexcept;  // gives back what this held first
  TokenReservation(const TokenReservation&) = delete;
  TokenReservation& operator=(const TokenReservation&) = delete;
  ~TokenReservation();

  // Ends the reservation: `used` (>= 0) tokens were generated. Used beyond
  // the reservation are taken too (the bucket may go negative). No-op when
  // empty or settled.
  void Settle(int64_t used);
  int64_t reserved() const { return reserved_; }

 private:
  friend class TenantRegistry;
  TokenReservation(std::shared_ptr<internal::TenantUsageState> usage, int64_t reserved);

  std::shared_ptr<internal::TenantUsageState> usage_;
  int64_t reserved_ = 0;
};

// One tenant's live usage, for metrics and tests.
struct TenantUsage {
  int64_t sequences = 0;       // sequence leases held
  int64_t jobs_in_flight = 0;  // job leases held
  int64_t document_bytes = 0;  // bytes reserved and not released
  // Tokens in the bucket now (negative: generated past the rate, being repaid);
  // nullopt when generated_tokens_per_minute is unlimited.
  std::optional<double> tokens_available;
};

// ---- the registry -------------------------------------------------------------

struct TenantRegistryOptions {
  // Seconds on a monotonic clock, read by the token buckets; tests pass a fake.
  // Default: std::chrono::steady_clock.
  std::function<double()> clock;
};

// The current tenants and their usage. Every method is thread-safe. A call
// naming a tenant that is not configured (never was, or removed by Reload)
// returns PermissionDenied, as the tenant's keys would.
class TenantRegistry {
 public:
  // InvalidArgument (naming the key path) for a configuration that
  // ValidateTenantsConfig refuses.
  static Result<std::unique_ptr<TenantRegistry>> Create(const TenantsConfig& config,
                                                        TenantRegistryOptions options = {});
  ~TenantRegistry();
  TenantRegistry(const TenantRegistry&) = delete;
  TenantRegistry& operator=(const TenantRegistry&) = delete;

  // The tenant whose key this is. PermissionDenied for an empty, unknown or
  // over-long key; the message never contains the key. The presented key is
  // hashed and compared with every configured hash without stopping at a
  // match, so the time taken does not depend on which key (if any) matched.
  //
  // `client_certificate`: the name (CN) of the caller's verified client
  // certificate of role client, "" when it presented none. A tenant with a
  // client_certificate is authenticated only when it matches; otherwise the
  // refusal is the same PermissionDenied as for an unknown key (it does not
  // tell whether the key was valid).
  Result<std::string> Authenticate(const std::string& api_key, std::string_view client_certificate = {}) const;
  // The message of every authentication refusal but the empty key's.
  static constexpr std::string_view kNotAuthorized =
      "the API key is not valid, or not accepted on this connection (a client certificate its tenant requires)";

  // Replaces the configuration atomically. Tenants still present keep their
  // usage (held leases, reserved bytes, token bucket) and get the new limits:
  // usage already over a lowered limit stays, and new acquisitions are refused
  // until it falls below. Removed tenants are forgotten (their outstanding
  // leases release harmlessly). On error nothing changes.
  Status Reload(const TenantsConfig& config);

  // The configuration in force now (a snapshot; later Reloads do not change it).
  std::shared_ptr<const TenantsConfig> config() const;
  // One tenant's configuration now; PermissionDenied when it is not configured.
  Result<TenantConfig> Tenant(const std::string& tenant) const;

  // True when `reader` may read `owner`'s corpora: its own namespace, or
  // `owner` is configured and lists `reader` in publishes_to.
  bool CanRead(const std::string& reader, const std::string& owner) const;

  // One sequence of max_concurrent_sequences into *lease (left empty on refusal).
  QuotaDecision AcquireSequence(const std::string& tenant, Lease* lease);
  // One job of max_jobs_in_flight into *lease (left empty on refusal).
  QuotaDecision AcquireJob(const std::string& tenant, Lease* lease);

  // Before admitting a generation that may produce up to `tokens` (>= 0):
  // takes them from the bucket into *reservation (left empty on refusal, and
  // for a tenant without generated_tokens_per_minute). InvalidArgument naming
  // the quota when `tokens` exceeds the bucket's capacity (it could never be
  // admitted); ResourceExhausted with the time until the bucket holds them
  // when it holds fewer now.
  QuotaDecision ReserveTokens(const std::string& tenant, int64_t tokens, TokenReservation* reservation);
  // ReserveTokens' InvalidArgument check alone (nothing is taken): whether a
  // generation of up to `tokens` can ever be admitted (a job's items, at
  // submission).
  QuotaDecision CheckTokensFit(const std::string& tenant, int64_t tokens) const;

  // OK when at least one token is in the bucket; else ResourceExhausted with
  // the time until one is.
  QuotaDecision CheckTokens(const std::string& tenant);
  // Records n (>= 0) tokens generated without a reservation. They are always
  // taken from the bucket, which may go negative (a debt repaid by the refill
  // before the next admission); the result is ResourceExhausted when the
  // tenant is now past its rate, with the time until CheckTokens passes again.
  QuotaDecision ChargeTokens(const std::string& tenant, int64_t n);

  // Reserves `bytes` (>= 0) of stored_document_bytes for a document about to
  // be stored. Refused whole (nothing reserved) when it would pass the quota;
  // InvalidArgument when it exceeds the whole quota (it never fits).
  QuotaDecision ReserveDocumentBytes(const std::string& tenant, int64_t bytes);
  // Gives back bytes reserved earlier (a document deleted or its store
  // failed). Releasing more than is reserved clamps at zero with a warning; an
  // unconfigured tenant is ignored.
  void ReleaseDocumentBytes(const std::string& tenant, int64_t bytes);

  // The tenant's usage now; PermissionDenied when it is not configured.
  Result<TenantUsage> Usage(const std::string& tenant) const;

 private:
  struct Snapshot;
  struct Entry;
  TenantRegistry(std::function<double()> clock, std::shared_ptr<const Snapshot> snapshot);
  std::shared_ptr<const Snapshot> Current() const;
  // The tenant's entry in `snap`, or PermissionDenied.
  static Result<const Entry*> Find(const Snapshot& snap, const std::string& tenant);
  QuotaDecision Acquire(const std::string& tenant, Lease::Kind kind, Lease* lease);
  // The token bucket: charge < 0 checks for one token; else takes `charge`.
  QuotaDecision Bucket(const std::string& tenant, int64_t charge);

  const std::function<double()> clock_;
  mutable std::mutex mu_;  // guards snapshot_ (the pointer, not what it points to)
  std::shared_ptr<const Snapshot> snapshot_;
  std::mutex reload_mu_;  // one Reload at a time
};

}  // namespace penumbra::tenants
