// Tenants (coordinator/tenants/tenants.h): the shipped config holds
// placeholders that are refused until replaced, and every bad key is refused
// by name; API keys hash (SHA-256 known
// answers), new keys are random, and keys authenticate without echoing (and
// only with their tenant's client certificate where it requires one); tokens
// are reserved up front and refunded; each quota refuses past its limit
// with a retry-after and leaves other tenants alone; the token bucket refills
// on a fake clock; Reload keeps usage; leases hold under 8 threads; a random
// sequence of quota operations matches a plain model; publishes_to. (The
// fair share itself is the worker scheduler's: tests/worker/scheduler_test.cc.)
#include <algorithm>
#include <atomic>
#include <cctype>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/file.h"
#include "coordinator/tenants/tenants.h"
#include "tests/test_util.h"

namespace penumbra::tenants {
namespace {

std::string HashOf(const std::string& key) {
  Result<std::string> h = HashApiKey(key);
  EXPECT_TRUE(h.ok()) << h.status();
  return h.ok() ? *h : std::string();
}

TenantConfig Tenant(const std::string& name, const std::string& key) {
  TenantConfig t;
  t.name = name;
  t.api_keys = {HashOf(key)};
  return t;
}

// A fake clock the token buckets read.
struct FakeClock {
  double now = 1000.0;
  std::function<double()> Fn() {
    return [this] { return now; };
  }
};

std::unique_ptr<TenantRegistry> MakeRegistry(const TenantsConfig& config, FakeClock* clock = nullptr) {
  TenantRegistryOptions o;
  if (clock) o.clock = clock->Fn();
  Result<std::unique_ptr<TenantRegistry>> r = TenantRegistry::Create(config, o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(r).value() : nullptr;
}

TenantUsage UsageOf(const TenantRegistry& reg, const std::string& tenant) {
  Result<TenantUsage> u = reg.Usage(tenant);
  EXPECT_TRUE(u.ok()) << u.status();
  return u.ok() ? *u : TenantUsage{};
}

// ---- configuration ----------------------------------------------------------------

// The shipped example holds placeholders that cannot work: loading it is
// refused with an error saying to replace them. With the placeholders
// replaced by the hashes of new keys (as its comments say), it loads, every
// key authenticates, and support's keys need its client certificate.
TEST(TenantsConfig, ShippedConfigIsRefusedUntilItsPlaceholdersAreReplaced) {
  const std::string path = testing::SourceDir() + "/configs/tenants.yaml";
  ASSERT_TRUE(testing::DataExists(path));
  Result<TenantsConfig> shipped = LoadTenantsConfig(path);
  ASSERT_FALSE(shipped.ok()) << "the shipped tenants.yaml loads: it must hold no working keys";
  EXPECT_EQ(shipped.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(shipped.status().message().find("tenants[0].api_keys[0]"), std::string::npos) << shipped.status();
  EXPECT_NE(shipped.status().message().find("placeholder"), std::string::npos) << shipped.status();
  EXPECT_NE(shipped.status().message().find("penumbra tenant new-key"), std::string::npos) << shipped.status();

  Result<std::string> text = ReadFileToString(path);
  ASSERT_TRUE(text.ok()) << text.status();
  const std::string research_key = NewApiKey(), support_key = NewApiKey();
  std::string replaced = *text;
  int placeholders = 0;
  for (const std::string& key : {research_key, support_key}) {
    const size_t at = replaced.find(std::string(kApiKeyPlaceholder));
    ASSERT_NE(at, std::string::npos);
    const size_t end = replaced.find_first_of(" \n", at);
    replaced.replace(at, end - at, HashOf(key));
    ++placeholders;
  }
  EXPECT_EQ(replaced.find(std::string(kApiKeyPlaceholder)), std::string::npos) << "more than two placeholders";
  EXPECT_EQ(placeholders, 2);
  Result<TenantsConfig> c = LoadTenantsConfigFromString(replaced, path);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->tenants.size(), 2u);
  const TenantConfig& research = c->tenants[0];
  const TenantConfig& support = c->tenants[1];
  EXPECT_EQ(research.name, "research");
  EXPECT_EQ(research.quotas.max_concurrent_sequences, 64);
  EXPECT_EQ(research.quotas.generated_tokens_per_minute, 600000);
  EXPECT_EQ(research.quotas.stored_document_bytes, int64_t{64} << 30);
  EXPECT_EQ(research.quotas.max_jobs_in_flight, 8);
  EXPECT_EQ(research.weight, 3.0);
  EXPECT_EQ(research.publishes_to, std::vector<std::string>{"support"});
  EXPECT_TRUE(research.admin);
  EXPECT_TRUE(research.client_certificate.empty());
  EXPECT_EQ(support.name, "support");
  EXPECT_EQ(support.quotas.max_concurrent_sequences, 16);
  EXPECT_FALSE(support.quotas.stored_document_bytes.has_value());
  EXPECT_FALSE(support.quotas.max_jobs_in_flight.has_value());
  EXPECT_EQ(support.weight, 1.0);
  EXPECT_TRUE(support.publishes_to.empty());
  EXPECT_FALSE(support.admin);
  EXPECT_EQ(support.client_certificate, "support-app");

  auto reg = MakeRegistry(*c);
  ASSERT_TRUE(reg);
  EXPECT_EQ(reg->Authenticate(research_key).value(), "research");
  EXPECT_EQ(reg->Authenticate(support_key, "support-app").value(), "support");
  EXPECT_EQ(reg->Authenticate(support_key).status().code(), StatusCode::kPermissionDenied);
}

TEST(TenantsConfig, APlaceholderIsRefusedWhereverItIs) {
  const std::string h0 = HashOf("key-zero-0123456789");
  Result<TenantsConfig> r = LoadTenantsConfigFromString(
      "tenants:\n  - name: a\n    api_keys: [" + h0 + ", " + std::string(kApiKeyPlaceholder) + "-ME]\n", "t.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("t.yaml: tenants[0].api_keys[1]: a placeholder"), std::string::npos)
      << r.status();
}

TEST(TenantsConfig, AdminAndClientCertificateAreReadAndChecked) {
  const std::string h0 = HashOf("key-zero-0123456789");
  Result<TenantsConfig> c = LoadTenantsConfigFromString("tenants:\n  - name: a\n    api_keys: [" + h0 +
                                                        "]\n    admin: true\n    client_certificate: app-1.prod\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->tenants[0].admin);
  EXPECT_EQ(c->tenants[0].client_certificate, "app-1.prod");
  for (const auto& [yaml, key] : std::vector<std::pair<std::string, std::string>>{
           {"    admin: maybe\n", "tenants[0].admin"},
           {"    client_certificate: \"a b\"\n", "tenants[0].client_certificate"},
           {"    client_certificate: \"" + std::string(65, 'x') + "\"\n", "tenants[0].client_certificate"},
           {"    client_certificate: [x]\n", "tenants[0].client_certificate"}}) {
    Result<TenantsConfig> r =
        LoadTenantsConfigFromString("tenants:\n  - name: a\n    api_keys: [" + h0 + "]\n" + yaml, "bad.yaml");
    ASSERT_FALSE(r.ok()) << yaml;
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status();
  }
}

TEST(TenantsConfig, AbsentKeysTakeTheirDefaults) {
  Result<TenantsConfig> c =
      LoadTenantsConfigFromString("tenants:\n  - name: a\n    api_keys: [" + HashOf("0123456789abcdef") + "]\n");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->tenants.size(), 1u);
  const TenantConfig& t = c->tenants[0];
  EXPECT_EQ(t.weight, 1.0);
  EXPECT_FALSE(t.quotas.max_concurrent_sequences.has_value());
  EXPECT_FALSE(t.quotas.generated_tokens_per_minute.has_value());
  EXPECT_FALSE(t.quotas.stored_document_bytes.has_value());
  EXPECT_FALSE(t.quotas.max_jobs_in_flight.has_value());
  EXPECT_TRUE(t.publishes_to.empty());
}

TEST(TenantsConfig, EachBadInputIsRefusedNamingItsKey) {
  const std::string h0 = HashOf("key-zero-0123456789"), h1 = HashOf("key-one-0123456789");
  // Tenant 0 is always valid; each case breaks something, mostly in tenant 1.
  const std::string t0 = "  - name: a\n    api_keys: [" + h0 + "]\n";
  auto with = [&](const std::string& tenant1) { return "tenants:\n" + t0 + tenant1; };
  const std::string t1_head = "  - name: b\n    api_keys: [" + h1 + "]\n";
  struct Case {
    std::string yaml;
    std::string key;  // the key path the message must name
  };
  const std::vector<Case> cases = {
      {"other: 1\ntenants:\n" + t0, "other: unknown key"},
      {"{}", "tenants: required"},
      {"tenants: {a: 1}", "tenants: expected a list"},
      {"tenants: []", "tenants: expected at least one tenant"},
      {with("  - just-a-string\n"), "tenants[1]: expected a map"},
      {with("  - api_keys: [" + h1 + "]\n"), "tenants[1].name: required"},
      {with("  - name: Bad.Name\n    api_keys: [" + h1 + "]\n"), "tenants[1].name: must be 1 to 64"},
      {with("  - name: " + std::string(65, 'x') + "\n    api_keys: [" + h1 + "]\n"),
       "tenants[1].name: must be 1 to 64"},
      {with("  - name: a\n    api_keys: [" + h1 + "]\n"), "tenants[1].name: 'a' is already the name of tenants[0]"},
      {with("  - name: b\n"), "tenants[1].api_keys: expected at least one key hash"},
      {with("  - name: b\n    api_keys: " + h1 + "\n"), "tenants[1].api_keys: expected a list of strings"},
      {with("  - name: b\n    api_keys: [" + h1 + ", [x]]\n"), "tenants[1].api_keys[1]: expected a string"},
      {with("  - name: b\n    api_keys: [sha256:abcd]\n"), "tenants[1].api_keys[0]: expected 'sha256:'"},
      {with("  - name: b\n    api_keys: [sha256:" + std::string(63, 'a') + "g]\n"), "tenants[1].api_keys[0]: expected"},
      {with("  - name: b\n    api_keys: [" + h1 + ", " + h0 + "]\n"),
       "tenants[1].api_keys[1]: the same key hash as tenants[0].api_keys[0]"},
      {with("  - name: b\n    api_keys: [" + h1 + ", " + h1 + "]\n"),
       "tenants[1].api_keys[1]: the same key hash as tenants[1].api_keys[0]"},
      {with(t1_head + "    quotas:\n      generated_tokens_per_minute: 0\n"),
       "tenants[1].quotas.generated_tokens_per_minute: must be >= 1"},
      {with(t1_head + "    quotas:\n      max_concurrent_sequences: -3\n"),
       "tenants[1].quotas.max_concurrent_sequences: must be >= 1"},
      {with(t1_head + "    quotas:\n      stored_document_bytes: lots\n"),
       "tenants[1].quotas.stored_document_bytes: expected an integer"},
      {with(t1_head + "    quotas:\n      max_jobs_in_flight: 18014398509481984\n"),
       "tenants[1].quotas.max_jobs_in_flight: must be <="},
      {with(t1_head + "    quotas:\n      max_sequences: 4\n"), "tenants[1].quotas.max_sequences: unknown key"},
      {with(t1_head + "    quotas: 5\n"), "tenants[1].quotas: expected a map"},
      {with(t1_head + "    weight: 0\n"), "tenants[1].weight: must be > 0"},
      {with(t1_head + "    weight: -2\n"), "tenants[1].weight: must be > 0"},
      {with(t1_head + "    weight: heavy\n"), "tenants[1].weight: expected a number"},
      {with(t1_head + "    colour: blue\n"), "tenants[1].colour: unknown key"},
      {with(t1_head + "    publishes_to: [nobody]\n"), "tenants[1].publishes_to[0]: no tenant is named 'nobody'"},
      {with(t1_head + "    publishes_to: [a, b]\n"), "tenants[1].publishes_to[1]: a tenant always reads its own"},
      {with(t1_head + "    publishes_to: [a, a]\n"), "tenants[1].publishes_to[1]: 'a' is listed twice"},
      {with(t1_head + "    publishes_to: a\n"), "tenants[1].publishes_to: expected a list of strings"},
      {"tenants: [\n", "YAML syntax error"},
  };
  for (const Case& c : cases) {
    Result<TenantsConfig> r = LoadTenantsConfigFromString(c.yaml, "bad.yaml");
    ASSERT_FALSE(r.ok()) << "accepted:\n" << c.yaml;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
    EXPECT_EQ(r.status().message().rfind("bad.yaml: ", 0), 0u) << r.status();
    EXPECT_NE(r.status().message().find(c.key), std::string::npos)
        << "expected '" << c.key << "' in: " << r.status() << "\nfor:\n"
        << c.yaml;
  }
}

TEST(TenantsConfig, APlaintextKeyInTheConfigIsRefusedWithoutEchoingIt) {
  const std::string secret = "my-real-secret-key-please-hide";
  Result<TenantsConfig> r = LoadTenantsConfigFromString("tenants:\n  - name: a\n    api_keys: [" + secret + "]\n");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tenants[0].api_keys[0]"), std::string::npos) << r.status();
  EXPECT_EQ(r.status().message().find(secret), std::string::npos) << r.status();
}

TEST(TenantsConfig, ValidateChecksAConfigBuiltInCode) {
  TenantsConfig c;
  c.tenants = {Tenant("a", "key-zero-0123456789"), Tenant("b", "key-one-0123456789")};
  EXPECT_TRUE(ValidateTenantsConfig(c).ok());
  c.tenants[1].weight = 0;
  Status s = ValidateTenantsConfig(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("tenants[1].weight"), std::string::npos) << s;
  EXPECT_FALSE(TenantRegistry::Create(c).ok());
}

TEST(TenantsConfig, AMissingFileIsAnErrorNamingIt) {
  Result<TenantsConfig> r = LoadTenantsConfig("/nonexistent/tenants.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("/nonexistent/tenants.yaml"), std::string::npos) << r.status();
}

// ---- API keys -----------------------------------------------------------------------

TEST(ApiKeys, Sha256KnownAnswers) {
  // FIPS 180-2 examples.
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(Sha256Hex(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(ApiKeys, HashApiKeyGivesTheConfigFormAndRefusesShortKeys) {
  Result<std::string> h = HashApiKey("abcabcabcabcabca");  // exactly 16 bytes
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(*h, "sha256:" + Sha256Hex("abcabcabcabcabca"));
  const std::string short_key = "fifteen-bytes!!";
  ASSERT_EQ(short_key.size(), 15u);
  Result<std::string> bad = HashApiKey(short_key);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message().find(short_key), std::string::npos) << bad.status();
}

TEST(ApiKeys, AuthenticateFindsTheTenantAndRefusesOthersWithoutEchoingTheKey) {
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789"), Tenant("b", "tenant-b-key-0123456789")};
  c.tenants[0].api_keys.push_back(HashOf("tenant-a-rotated-key-000"));
  auto reg = MakeRegistry(c);
  ASSERT_TRUE(reg);
  EXPECT_EQ(reg->Authenticate("tenant-a-key-0123456789").value(), "a");
  EXPECT_EQ(reg->Authenticate("tenant-a-rotated-key-000").value(), "a");
  EXPECT_EQ(reg->Authenticate("tenant-b-key-0123456789").value(), "b");
  const std::vector<std::string> wrong = {"tenant-c-key-0123456789",           "tenant-a-key-012345678",
                                          "TENANT-A-KEY-0123456789",           "",
                                          HashOf("tenant-a-key-0123456789"),  // the stored hash itself is not a key
                                          Sha256Hex("tenant-a-key-0123456789")};
  for (const std::string& key : wrong) {
    Result<std::string> r = reg->Authenticate(key);
    ASSERT_FALSE(r.ok()) << key;
    EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied) << r.status();
    if (!key.empty()) {
      EXPECT_EQ(r.status().message().find(key), std::string::npos) << r.status();
    }
  }
}

TEST(ApiKeys, NewApiKeyIsRandomUrlSafeAndHashable) {
  std::set<std::string> seen;
  for (int i = 0; i < 64; ++i) {
    const std::string key = NewApiKey();
    ASSERT_EQ(key.rfind("pk-", 0), 0u) << key;
    // 32 random bytes in base64url without padding: 43 characters.
    ASSERT_EQ(key.size(), 3u + 43u) << key;
    for (char ch : key.substr(3)) {
      ASSERT_TRUE(std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_') << key;
    }
    EXPECT_TRUE(HashApiKey(key).ok());
    EXPECT_TRUE(seen.insert(key).second) << "a key came twice: " << key;
  }
  // Every character position takes many values: not a fixed pattern.
  std::set<char> first;
  for (const std::string& k : seen) first.insert(k[3]);
  EXPECT_GT(first.size(), 16u);
}

// A tenant with client_certificate: its key works only with that
// certificate's name; without it, or with another, the refusal is the same
// as for a key that is not valid at all.
TEST(ApiKeys, AClientCertificateTenantNeedsItsCertificateAndTheRefusalRevealsNothing) {
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789"), Tenant("b", "tenant-b-key-0123456789")};
  c.tenants[1].client_certificate = "app-b";
  auto reg = MakeRegistry(c);
  ASSERT_TRUE(reg);
  EXPECT_EQ(reg->Authenticate("tenant-a-key-0123456789").value(), "a");
  EXPECT_EQ(reg->Authenticate("tenant-a-key-0123456789", "app-b").value(), "a");  // a requires none
  EXPECT_EQ(reg->Authenticate("tenant-b-key-0123456789", "app-b").value(), "b");
  const Result<std::string> unknown = reg->Authenticate("tenant-x-key-0123456789", "app-b");
  ASSERT_FALSE(unknown.ok());
  for (const std::string& cert : {std::string(), std::string("app-a"), std::string("app-b2"), std::string("APP-B")}) {
    Result<std::string> r = reg->Authenticate("tenant-b-key-0123456789", cert);
    ASSERT_FALSE(r.ok()) << cert;
    EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied);
    EXPECT_EQ(r.status().message(), unknown.status().message()) << "the refusal tells a valid key apart";
  }
  // An over-long key is refused as any other (before it is hashed).
  Result<std::string> long_key = reg->Authenticate(std::string(kMaxApiKeyBytes + 1, 'k'));
  ASSERT_FALSE(long_key.ok());
  EXPECT_EQ(long_key.status().message(), unknown.status().message());
}

// ---- quotas -------------------------------------------------------------------------

TEST(Quotas, SequencesAreRefusedPastTheLimitAndFreedByTheLease) {
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789"), Tenant("b", "tenant-b-key-0123456789")};
  c.tenants[0].quotas.max_concurrent_sequences = 2;
  auto reg = MakeRegistry(c);
  ASSERT_TRUE(reg);
  Lease l1, l2, l3;
  ASSERT_TRUE(reg->AcquireSequence("a", &l1).ok());
  ASSERT_TRUE(reg->AcquireSequence("a", &l2).ok());
  EXPECT_TRUE(l1.held() && l2.held());
  QuotaDecision d = reg->AcquireSequence("a", &l3);
  EXPECT_EQ(d.status.code(), StatusCode::kResourceExhausted) << d.status;
  EXPECT_TRUE(d.status.retryable());
  EXPECT_EQ(d.retry_after_s, kQuotaRetryAfterSeconds);
  EXPECT_EQ(d.retry_after_ms(), 1000);
  EXPECT_NE(d.status.message().find("max_concurrent_sequences"), std::string::npos) << d.status;
  EXPECT_FALSE(l3.held());
  EXPECT_EQ(UsageOf(*reg, "a").sequences, 2);

  // b (unlimited) is unaffected.
  std::vector<Lease> b(100);
  for (Lease& l : b) ASSERT_TRUE(reg->AcquireSequence("b", &l).ok());
  EXPECT_EQ(UsageOf(*reg, "b").sequences, 100);
  b.clear();
  EXPECT_EQ(UsageOf(*reg, "b").sequences, 0);

  // Moving a lease moves the unit; destroying it gives it back.
  Lease moved = std::move(l1);
  EXPECT_FALSE(l1.held());  // NOLINT(bugprone-use-after-move): the moved-from lease is what is checked
  EXPECT_TRUE(moved.held());
  EXPECT_EQ(UsageOf(*reg, "a").sequences, 2);
  { Lease gone = std::move(moved); }
  EXPECT_EQ(UsageOf(*reg, "a").sequences, 1);
  EXPECT_TRUE(reg->AcquireSequence("a", &l3).ok());
  l2.Release();
  l2.Release();  // a second release is a no-op
  EXPECT_EQ(UsageOf(*reg, "a").sequences, 1);
  // Assigning over a held lease releases the old unit.
  ASSERT_TRUE(reg->AcquireSequence("a", &l2).ok());
  EXPECT_EQ(UsageOf(*reg, "a").sequences, 2);
  l3 = std::move(l2);
  EXPECT_EQ(UsageOf(*reg, "a").sequences, 1);
}

TEST(Quotas, JobsAreRefusedPastTheLimit) {
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789"), Tenant("b", "tenant-b-key-0123456789")};
  c.tenants[0].quotas.max_jobs_in_flight = 1;
  c.tenants[1].quotas.max_jobs_in_flight = 1;
  auto reg = MakeRegistry(c);
  ASSERT_TRUE(reg);
  Lease a1, a2, b1, seq;
  ASSERT_TRUE(reg->AcquireJob("a", &a1).ok());
  QuotaDecision d = reg->AcquireJob("a", &a2);
  EXPECT_EQ(d.status.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(d.retry_after_s, kQuotaRetryAfterSeconds);
  EXPECT_NE(d.status.message().find("max_jobs_in_flight"), std::string::npos) << d.status;
  EXPECT_TRUE(reg->AcquireJob("b", &b1).ok());
  EXPECT_TRUE(reg->AcquireSequence("a", &seq).ok());  // jobs and sequences are separate
  EXPECT_EQ(UsageOf(*reg, "a").jobs_in_flight, 1);
  EXPECT_EQ(UsageOf(*reg, "a").sequences, 1);
  a1.Release();
  EXPECT_TRUE(reg->AcquireJob("a", &a2).ok());
}

TEST(Quotas, DocumentBytesAreRefusedWholeAndFreedByRelease) {
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789"), Tenant("b", "tenant-b-key-0123456789")};
  c.tenants[0].quotas.stored_document_bytes = 1000;
  c.tenants[1].quotas.stored_document_bytes = 1000;
  auto reg = MakeRegistry(c);
  ASSERT_TRUE(reg);
  EXPECT_TRUE(reg->ReserveDocumentBytes("a", 600).ok());
  QuotaDecision d = reg->ReserveDocumentBytes("a", 401);
  EXPECT_EQ(d.status.code(), StatusCode::kResourceExhausted) << d.status;
  EXPECT_GT(d.retry_after_s, 0);
  EXPECT_NE(d.status.message().find("stored_document_bytes"), std::string::npos) << d.status;
  EXPECT_EQ(UsageOf(*reg, "a").document_bytes, 600);       // nothing reserved by the refusal
  EXPECT_TRUE(reg->ReserveDocumentBytes("b", 1000).ok());  // b has its own
  EXPECT_TRUE(reg->ReserveDocumentBytes("a", 400).ok());
  EXPECT_EQ(UsageOf(*reg, "a").document_bytes, 1000);
  EXPECT_EQ(reg->ReserveDocumentBytes("a", 1).status.code(), StatusCode::kResourceExhausted);
  reg->ReleaseDocumentBytes("a", 600);
  EXPECT_TRUE(reg->ReserveDocumentBytes("a", 500).ok());
  EXPECT_EQ(UsageOf(*reg, "a").document_bytes, 900);
  // Larger than the whole quota never fits: not worth retrying.
  EXPECT_EQ(reg->ReserveDocumentBytes("a", 1001).status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg->ReserveDocumentBytes("a", -1).status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(UsageOf(*reg, "a").document_bytes, 900);
  reg->ReleaseDocumentBytes("a", 5000);  // more than reserved: clamped
  EXPECT_EQ(UsageOf(*reg, "a").document_bytes, 0);
  EXPECT_EQ(UsageOf(*reg, "b").document_bytes, 1000);
}

TEST(Quotas, TokenBucketRefusesWhenEmptyAndRefillsOnTheClock) {
  FakeClock clock;
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789"), Tenant("b", "tenant-b-key-0123456789"),
               Tenant("c", "tenant-c-key-0123456789")};
  c.tenants[0].quotas.generated_tokens_per_minute = 60;  // 1 token a second
  c.tenants[1].quotas.generated_tokens_per_minute = 60;
  auto reg = MakeRegistry(c, &clock);
  ASSERT_TRUE(reg);
  EXPECT_EQ(UsageOf(*reg, "a").tokens_available, 60.0);  // starts full
  EXPECT_FALSE(UsageOf(*reg, "c").tokens_available.has_value());

  EXPECT_TRUE(reg->CheckTokens("a").ok());
  EXPECT_TRUE(reg->ChargeTokens("a", 60).ok());
  QuotaDecision d = reg->CheckTokens("a");
  EXPECT_EQ(d.status.code(), StatusCode::kResourceExhausted) << d.status;
  EXPECT_DOUBLE_EQ(d.retry_after_s, 1.0);
  EXPECT_NE(d.status.message().find("generated_tokens_per_minute"), std::string::npos) << d.status;

  // Charging past the rate records the tokens (a debt) and says so.
  d = reg->ChargeTokens("a", 2);
  EXPECT_EQ(d.status.code(), StatusCode::kResourceExhausted) << d.status;
  EXPECT_DOUBLE_EQ(d.retry_after_s, 3.0);  // from -2 back to 1
  EXPECT_EQ(d.retry_after_ms(), 3000);
  EXPECT_DOUBLE_EQ(*UsageOf(*reg, "a").tokens_available, -2.0);

  // Other tenants are unaffected.
  EXPECT_TRUE(reg->CheckTokens("b").ok());
  EXPECT_TRUE(reg->ChargeTokens("c", 1000000).ok());  // unlimited
  EXPECT_TRUE(reg->CheckTokens("c").ok());

  clock.now += 2.0;
  d = reg->CheckTokens("a");
  EXPECT_EQ(d.status.code(), StatusCode::kResourceExhausted);
  EXPECT_DOUBLE_EQ(d.retry_after_s, 1.0);
  clock.now += 0.5;
  EXPECT_DOUBLE_EQ(reg->CheckTokens("a").retry_after_s, 0.5);
  clock.now += 0.5;
  EXPECT_TRUE(reg->CheckTokens("a").ok());
  EXPECT_TRUE(reg->ChargeTokens("a", 1).ok());
  EXPECT_FALSE(reg->CheckTokens("a").ok());

  // The refill stops at a minute's worth.
  clock.now += 3600.0;
  EXPECT_DOUBLE_EQ(*UsageOf(*reg, "a").tokens_available, 60.0);
  EXPECT_EQ(reg->ChargeTokens("a", -1).status.code(), StatusCode::kInvalidArgument);
}

TEST(Quotas, TokenBucketRetryAfterFollowsTheRate) {
  FakeClock clock;
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789")};
  c.tenants[0].quotas.generated_tokens_per_minute = 120;  // 2 a second
  auto reg = MakeRegistry(c, &clock);
  ASSERT_TRUE(reg);
  EXPECT_EQ(reg->ChargeTokens("a", 130).status.code(), StatusCode::kResourceExhausted);
  QuotaDecision d = reg->CheckTokens("a");
  EXPECT_DOUBLE_EQ(d.retry_after_s, 5.5);  // from -10 to 1 at 2/s
  clock.now += d.retry_after_s;
  EXPECT_TRUE(reg->CheckTokens("a").ok());
}

// Tokens are taken when a generation is admitted, not when it ends: a tenant
// of 100 tokens a minute cannot have more than 100 (plus the refill) in
// generations at once, and what a generation did not use comes back.
TEST(Quotas, TokensAreReservedUpFrontAndTheUnusedPartIsRefunded) {
  FakeClock clock;
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789"), Tenant("u", "tenant-u-key-0123456789")};
  c.tenants[0].quotas.generated_tokens_per_minute = 100;
  auto reg = MakeRegistry(c, &clock);
  ASSERT_TRUE(reg);

  TokenReservation r1, r2, r3;
  ASSERT_TRUE(reg->ReserveTokens("a", 60, &r1).ok());
  EXPECT_EQ(r1.reserved(), 60);
  EXPECT_DOUBLE_EQ(*UsageOf(*reg, "a").tokens_available, 40.0);
  // 50 more do not fit now: refused whole, with the time until they do.
  QuotaDecision d = reg->ReserveTokens("a", 50, &r2);
  EXPECT_EQ(d.status.code(), StatusCode::kResourceExhausted) << d.status;
  EXPECT_NE(d.status.message().find("generated_tokens_per_minute"), std::string::npos) << d.status;
  EXPECT_DOUBLE_EQ(d.retry_after_s, 6.0);  // 10 tokens at 100 a minute
  EXPECT_EQ(r2.reserved(), 0);
  EXPECT_DOUBLE_EQ(*UsageOf(*reg, "a").tokens_available, 40.0);
  // More than the bucket ever holds: InvalidArgument naming the quota.
  d = reg->ReserveTokens("a", 101, &r2);
  EXPECT_EQ(d.status.code(), StatusCode::kInvalidArgument) << d.status;
  EXPECT_NE(d.status.message().find("generated_tokens_per_minute quota of 100"), std::string::npos) << d.status;
  EXPECT_EQ(reg->CheckTokensFit("a", 101).status.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(reg->CheckTokensFit("a", 100).ok());
  EXPECT_DOUBLE_EQ(*UsageOf(*reg, "a").tokens_available, 40.0);  // CheckTokensFit takes nothing

  // r1 used 15 of its 60: 45 come back.
  r1.Settle(15);
  EXPECT_EQ(r1.reserved(), 0);
  EXPECT_DOUBLE_EQ(*UsageOf(*reg, "a").tokens_available, 85.0);
  r1.Settle(0);  // settled already: nothing more
  EXPECT_DOUBLE_EQ(*UsageOf(*reg, "a").tokens_available, 85.0);
  // A reservation dropped unsettled (the generation never ran) gives all back.
  {
    TokenReservation dropped;
    ASSERT_TRUE(reg->ReserveTokens("a", 80, &dropped).ok());
    EXPECT_DOUBLE_EQ(*UsageOf(*reg, "a").tokens_available, 5.0);
  }
  EXPECT_DOUBLE_EQ(*UsageOf(*reg, "a").tokens_available, 85.0);
  // A refund never fills the bucket past its capacity.
  ASSERT_TRUE(reg->ReserveTokens("a", 50, &r3).ok());
  clock.now += 60.0;  // refilled to 100 meanwhile
  r3.Settle(0);
  EXPECT_DOUBLE_EQ(*UsageOf(*reg, "a").tokens_available, 100.0);
  // Moving a reservation moves what it holds.
  TokenReservation moved;
  ASSERT_TRUE(reg->ReserveTokens("a", 30, &r3).ok());
  moved = std::move(r3);
  EXPECT_EQ(moved.reserved(), 30);
  EXPECT_EQ(r3.reserved(), 0);  // NOLINT(bugprone-use-after-move): the moved-from state is checked
  moved.Settle(30);
  EXPECT_DOUBLE_EQ(*UsageOf(*reg, "a").tokens_available, 70.0);

  // A tenant without the quota reserves nothing and is never refused.
  TokenReservation u;
  EXPECT_TRUE(reg->ReserveTokens("u", 1 << 30, &u).ok());
  EXPECT_EQ(u.reserved(), 0);
  EXPECT_TRUE(reg->CheckTokensFit("u", int64_t{1} << 40).ok());
  EXPECT_EQ(reg->ReserveTokens("a", -1, &u).status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg->ReserveTokens("z", 1, &u).status.code(), StatusCode::kPermissionDenied);
}

// The case: 100 tokens a minute, generations that each ask for up to
// 100 and use all of it, admitted as soon as the quota lets them, for ten
// minutes: never more than 100 a minute plus the first minute's bucket.
TEST(Quotas, HundredTokensAMinuteNeverProduceFifteenHundred) {
  FakeClock clock;
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789")};
  c.tenants[0].quotas.generated_tokens_per_minute = 100;
  auto reg = MakeRegistry(c, &clock);
  ASSERT_TRUE(reg);
  const double start = clock.now;
  int64_t generated = 0;
  std::vector<TokenReservation> running;
  while (clock.now - start < 600.0) {
    TokenReservation r;
    QuotaDecision d = reg->ReserveTokens("a", 100, &r);
    if (d.ok()) {
      running.push_back(std::move(r));
    } else {
      ASSERT_EQ(d.status.code(), StatusCode::kResourceExhausted) << d.status;
      ASSERT_GT(d.retry_after_s, 0);
    }
    // Generations end after 5 s, each having used its whole reservation.
    clock.now += 5.0;
    for (TokenReservation& done : running) {
      generated += done.reserved();
      done.Settle(done.reserved());
    }
    running.clear();
  }
  EXPECT_LE(generated, 100 + 10 * 100) << "generated past the rate";
  EXPECT_GE(generated, 10 * 100 - 100) << "the quota admitted less than its rate";
}

TEST(Quotas, AReservationSurvivesAReloadThatRemovesTheQuota) {
  FakeClock clock;
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789")};
  c.tenants[0].quotas.generated_tokens_per_minute = 100;
  auto reg = MakeRegistry(c, &clock);
  ASSERT_TRUE(reg);
  TokenReservation r;
  ASSERT_TRUE(reg->ReserveTokens("a", 70, &r).ok());
  c.tenants[0].quotas.generated_tokens_per_minute.reset();
  ASSERT_TRUE(reg->Reload(c).ok());
  TokenReservation u;
  EXPECT_TRUE(reg->ReserveTokens("a", 1000, &u).ok());  // unlimited now
  r.Settle(10);                                         // harmless
  c.tenants[0].quotas.generated_tokens_per_minute = 100;
  ASSERT_TRUE(reg->Reload(c).ok());
  EXPECT_DOUBLE_EQ(*UsageOf(*reg, "a").tokens_available, 100.0);  // starts full again
  reg.reset();
  u.Settle(0);  // past the registry: harmless
}

TEST(Quotas, AnUnconfiguredTenantIsPermissionDenied) {
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789")};
  auto reg = MakeRegistry(c);
  ASSERT_TRUE(reg);
  Lease l;
  EXPECT_EQ(reg->AcquireSequence("z", &l).status.code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reg->AcquireJob("z", &l).status.code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reg->CheckTokens("z").status.code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reg->ChargeTokens("z", 1).status.code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reg->ReserveDocumentBytes("z", 1).status.code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reg->Usage("z").status().code(), StatusCode::kPermissionDenied);
  reg->ReleaseDocumentBytes("z", 1);  // ignored
  EXPECT_FALSE(l.held());
}

TEST(Registry, ReloadKeepsUsageAppliesNewLimitsAndDropsRemovedTenants) {
  FakeClock clock;
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789"), Tenant("b", "tenant-b-key-0123456789")};
  c.tenants[0].quotas.max_concurrent_sequences = 4;
  c.tenants[0].quotas.generated_tokens_per_minute = 60;
  c.tenants[0].quotas.stored_document_bytes = 1000;
  auto reg = MakeRegistry(c, &clock);
  ASSERT_TRUE(reg);
  std::vector<Lease> a(3);
  for (Lease& l : a) ASSERT_TRUE(reg->AcquireSequence("a", &l).ok());
  Lease a_job, b_seq;
  ASSERT_TRUE(reg->AcquireJob("a", &a_job).ok());
  ASSERT_TRUE(reg->AcquireSequence("b", &b_seq).ok());
  ASSERT_TRUE(reg->ReserveDocumentBytes("a", 700).ok());
  ASSERT_TRUE(reg->ChargeTokens("a", 50).ok());

  // A bad config changes nothing.
  TenantsConfig bad = c;
  bad.tenants[1].name = "a";
  EXPECT_EQ(reg->Reload(bad).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg->config()->tenants.size(), 2u);
  EXPECT_EQ(reg->Authenticate("tenant-b-key-0123456789").value(), "b");

  // a stays with a lower sequence limit and a new key; b goes; c arrives.
  TenantsConfig next;
  next.tenants = {Tenant("a", "tenant-a-new-key-0123456789"), Tenant("c", "tenant-c-key-0123456789")};
  next.tenants[0].quotas = c.tenants[0].quotas;
  next.tenants[0].quotas.max_concurrent_sequences = 2;
  const std::shared_ptr<const TenantsConfig> before = reg->config();
  ASSERT_TRUE(reg->Reload(next).ok());
  EXPECT_EQ(before->tenants[1].name, "b");  // an earlier snapshot is unchanged
  EXPECT_EQ(reg->config()->tenants[1].name, "c");

  TenantUsage u = UsageOf(*reg, "a");
  EXPECT_EQ(u.sequences, 3);
  EXPECT_EQ(u.jobs_in_flight, 1);
  EXPECT_EQ(u.document_bytes, 700);
  EXPECT_DOUBLE_EQ(*u.tokens_available, 10.0);
  EXPECT_EQ(reg->ReserveDocumentBytes("a", 301).status.code(), StatusCode::kResourceExhausted);

  // 3 held over the new limit of 2: refused until below it.
  Lease l;
  EXPECT_EQ(reg->AcquireSequence("a", &l).status.code(), StatusCode::kResourceExhausted);
  a[0].Release();
  EXPECT_EQ(reg->AcquireSequence("a", &l).status.code(), StatusCode::kResourceExhausted);
  a[1].Release();
  EXPECT_TRUE(reg->AcquireSequence("a", &l).ok());

  // Keys follow the new config.
  EXPECT_EQ(reg->Authenticate("tenant-a-new-key-0123456789").value(), "a");
  EXPECT_EQ(reg->Authenticate("tenant-a-key-0123456789").status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reg->Authenticate("tenant-b-key-0123456789").status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reg->Authenticate("tenant-c-key-0123456789").value(), "c");

  // b is gone; its lease still releases harmlessly. Brought back, it starts
  // from zero.
  EXPECT_EQ(reg->Usage("b").status().code(), StatusCode::kPermissionDenied);
  b_seq.Release();
  EXPECT_FALSE(b_seq.held());
  TenantsConfig again = next;
  again.tenants.push_back(Tenant("b", "tenant-b-key-0123456789"));
  ASSERT_TRUE(reg->Reload(again).ok());
  EXPECT_EQ(UsageOf(*reg, "b").sequences, 0);
  EXPECT_EQ(UsageOf(*reg, "a").sequences, 2);  // a[2] and l
}

TEST(Registry, EightThreadsNeverHoldMoreSequencesThanTheLimit) {
  constexpr int kLimit = 3, kThreads = 8, kRounds = 3000;
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789")};
  c.tenants[0].quotas.max_concurrent_sequences = kLimit;
  auto reg = MakeRegistry(c);
  ASSERT_TRUE(reg);
  std::atomic<int> in_use{0}, max_seen{0}, granted{0}, refused{0}, wrong_code{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kRounds; ++i) {
        Lease l;
        QuotaDecision d = reg->AcquireSequence("a", &l);
        if (!d.ok()) {
          if (d.status.code() != StatusCode::kResourceExhausted) ++wrong_code;
          ++refused;
          continue;
        }
        ++granted;
        const int now = ++in_use;
        int seen = max_seen.load();
        while (now > seen && !max_seen.compare_exchange_weak(seen, now)) {
        }
        std::this_thread::yield();
        --in_use;
      }  // l released here, after in_use dropped
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(max_seen.load(), kLimit);
  EXPECT_GE(max_seen.load(), 1);
  EXPECT_EQ(wrong_code.load(), 0);
  EXPECT_EQ(granted.load() + refused.load(), kThreads * kRounds);
  EXPECT_GT(granted.load(), 0);
  EXPECT_EQ(UsageOf(*reg, "a").sequences, 0);
}

// Random acquires, releases, reserves and reloads across three tenants,
// compared with a plain model after every step.
TEST(Registry, MatchesAModelUnderRandomQuotaOperations) {
  const std::vector<std::string> names = {"a", "b", "c"};
  std::mt19937_64 rng(19);
  auto random_config = [&] {
    TenantsConfig c;
    for (const std::string& n : names) {
      TenantConfig t = Tenant(n, "key-of-tenant-" + n + "-0123456789");
      t.quotas.max_concurrent_sequences = 1 + static_cast<int64_t>(rng() % 4);
      t.quotas.max_jobs_in_flight = 1 + static_cast<int64_t>(rng() % 3);
      t.quotas.stored_document_bytes = 100 + static_cast<int64_t>(rng() % 200);
      c.tenants.push_back(t);
    }
    return c;
  };
  TenantsConfig config = random_config();
  auto reg = MakeRegistry(config);
  ASSERT_TRUE(reg);
  struct Model {
    std::vector<Lease> sequences, jobs;
    int64_t bytes = 0;
  };
  std::map<std::string, Model> model;
  for (int step = 0; step < 5000; ++step) {
    const size_t ti = rng() % names.size();
    const std::string& name = names[ti];
    const TenantQuotas& q = config.tenants[ti].quotas;
    Model& m = model[name];
    const int op = static_cast<int>(rng() % 7);
    if (op == 0 || op == 1) {
      const bool seq = op == 0;
      std::vector<Lease>& held = seq ? m.sequences : m.jobs;
      const int64_t limit = seq ? *q.max_concurrent_sequences : *q.max_jobs_in_flight;
      Lease l;
      QuotaDecision d = seq ? reg->AcquireSequence(name, &l) : reg->AcquireJob(name, &l);
      const bool expect_ok = static_cast<int64_t>(held.size()) < limit;
      ASSERT_EQ(d.ok(), expect_ok) << "step " << step << ": " << d.status;
      if (!expect_ok) {
        ASSERT_EQ(d.status.code(), StatusCode::kResourceExhausted);
      }
      if (d.ok()) held.push_back(std::move(l));
    } else if (op == 2 || op == 3) {
      std::vector<Lease>& held = op == 2 ? m.sequences : m.jobs;
      if (!held.empty()) held.erase(held.begin() + static_cast<long>(rng() % held.size()));
    } else if (op == 4) {
      const int64_t bytes = static_cast<int64_t>(rng() % 120);
      QuotaDecision d = reg->ReserveDocumentBytes(name, bytes);
      const bool expect_ok = m.bytes + bytes <= *q.stored_document_bytes;
      ASSERT_EQ(d.ok(), expect_ok) << "step " << step << ": " << d.status;
      if (d.ok()) m.bytes += bytes;
    } else if (op == 5) {
      const int64_t bytes = std::min<int64_t>(m.bytes, static_cast<int64_t>(rng() % 120));
      reg->ReleaseDocumentBytes(name, bytes);
      m.bytes -= bytes;
    } else if (rng() % 20 == 0) {
      config = random_config();
      ASSERT_TRUE(reg->Reload(config).ok());
    }
    for (const std::string& n : names) {
      const TenantUsage u = UsageOf(*reg, n);
      ASSERT_EQ(u.sequences, static_cast<int64_t>(model[n].sequences.size())) << "step " << step;
      ASSERT_EQ(u.jobs_in_flight, static_cast<int64_t>(model[n].jobs.size())) << "step " << step;
      ASSERT_EQ(u.document_bytes, model[n].bytes) << "step " << step;
    }
  }
}

TEST(Registry, CanReadItsOwnAndWhatIsPublishedToIt) {
  TenantsConfig c;
  c.tenants = {Tenant("a", "tenant-a-key-0123456789"), Tenant("b", "tenant-b-key-0123456789"),
               Tenant("c", "tenant-c-key-0123456789")};
  c.tenants[0].publishes_to = {"b"};
  auto reg = MakeRegistry(c);
  ASSERT_TRUE(reg);
  EXPECT_TRUE(reg->CanRead("a", "a"));
  EXPECT_TRUE(reg->CanRead("b", "a"));   // a publishes to b
  EXPECT_FALSE(reg->CanRead("a", "b"));  // not the other way round
  EXPECT_FALSE(reg->CanRead("c", "a"));
  EXPECT_FALSE(reg->CanRead("c", "b"));
  EXPECT_FALSE(reg->CanRead("b", "nobody"));
  c.tenants[0].publishes_to = {"c"};
  ASSERT_TRUE(reg->Reload(c).ok());
  EXPECT_FALSE(reg->CanRead("b", "a"));
  EXPECT_TRUE(reg->CanRead("c", "a"));
}

}  // namespace
}  // namespace penumbra::tenants
