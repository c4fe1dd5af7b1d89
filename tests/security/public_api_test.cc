// The public API against one tenant attacking the others (issue 37), with
// real processes on loopback (penumbra-worker, penumbra-coordinator with a
// tenants file; TLS where a client certificate matters):
// - oversized inputs (20,000 copies of one document id, 10 million stop ids,
//   deadline_ms 1e13, a 30 MiB job metadata, ...) are each INVALID_ARGUMENT
//   naming the limit, from three clients at once, while another tenant's
//   requests all succeed and the coordinator's memory stays bounded;
// - the generated-token quota is reserved up front: a tenant of 100 tokens a
//   minute asking for 15 x 100 at once gets 100;
// - a tenant that requires a client certificate is refused without it and
//   with another client's, indistinguishably from a wrong key, and served
//   with it;
// - public Health reveals no path or address; only an admin tenant's Stats
//   lists the workers;
// - request ids are 128 random bits and guessed or another tenant's ids find
//   nothing.
#include <atomic>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>

#include "tests/service/service_calls.h"
#include "tests/service/service_cluster.h"
#include "tests/worker/stories_shadowkv.h"

namespace penumbra::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

class PublicApi : public StoriesTest {};

// A fresh API key and its tenants.yaml hash.
struct Key {
  std::string key = "key-" + RandomHandle();
  std::string hash() const {
    const Sha256Digest d = Sha256(key);
    return "sha256:" + HexOf(std::string(d.begin(), d.end()));
  }
};

// `s` is INVALID_ARGUMENT naming `limit`.
::testing::AssertionResult RefusedNaming(const Status& s, const std::string& limit) {
  if (s.code() != StatusCode::kInvalidArgument) return ::testing::AssertionFailure() << "not INVALID_ARGUMENT: " << s;
  if (s.message().find(limit) == std::string::npos) {
    return ::testing::AssertionFailure() << "'" << limit << "' not named: " << s;
  }
  return ::testing::AssertionSuccess();
}

// A process's peak resident memory (VmHWM), bytes.
int64_t PeakRss(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// Three attackers send each oversized input again and again for a few
// seconds; every one is refused naming its limit, the victim tenant's
// requests all succeed meanwhile, and the coordinator's peak memory stays
// far below what concatenating 20,000 copies of a document took (2.65 GiB).
TEST_F(PublicApi, OversizedInputsAreRefusedNamingTheLimitWhileAnotherTenantIsServed) {
  const Key attacker_key, victim_key;
  ClusterOptions o;
  o.tenants_yaml = "tenants:\n  - name: attacker\n    api_keys: [" + attacker_key.hash() +
                   "]\n  - name: victim\n    api_keys: [" + victim_key.hash() + "]\n";
  Cluster cluster(o);
  ASSERT_TRUE(cluster.StartWorker(0));
  ASSERT_TRUE(cluster.StartCoordinator({"--data-dir", cluster.dir() + "/data"}));
  auto setup = cluster.Client(attacker_key.key);
  ASSERT_TRUE(setup);
  const std::vector<int32_t> doc_tokens = LcgTokens(100, 7, true);
  auto doc = setup->PutDocument("d", nullptr, &doc_tokens);
  ASSERT_TRUE(doc.ok()) << doc.status();
  const std::string doc_id = doc->id;

  // Each attack and the limit its refusal must name.
  struct Attack {
    std::string name, limit;
    std::function<Status(client::Client&)> send;
  };
  const std::vector<Attack> attacks = {
      {"20000 copies of one document id", "max_document_ids",
       [&](client::Client& c) {
         return c.Generate(Ask(std::vector<std::string>(20000, doc_id), {5, 6}, 4)).status();
       }},
      {"10 million stop ids", "max_stop_ids",
       [&](client::Client& c) {
         rpc::GenerateRequest r = Ask({doc_id}, {5, 6}, 4);
         r.stop_ids.assign(10000000, 7);
         return c.Generate(r).status();
       }},
      {"deadline_ms 1e13", "max_deadline_ms",
       [&](client::Client& c) {
         rpc::GenerateRequest r = Ask({}, {5, 6}, 4);
         r.deadline_ms = 10000000000000;
         return c.Generate(r).status();
       }},
      {"a 30 MiB job metadata", "max_job_metadata_bytes",
       [&](client::Client& c) {
         rpc::SubmitJobRequest j;
         rpc::JobItem it;
         it.custom_id = "a";
         it.request = Ask({}, {5, 6}, 4);
         j.items = {it};
         j.metadata = std::string(30 << 20, 'm');
         return c.SubmitJob(j).status();
       }},
      {"a job of 50001 items", "max_job_items",
       [&](client::Client& c) {
         rpc::SubmitJobRequest j;
         j.items.resize(50001);
         return c.SubmitJob(j).status();
       }},
      {"a million stop strings", "max_stop_strings",
       [&](client::Client& c) {
         rpc::GenerateRequest r = Ask({}, {5, 6}, 4);
         r.stop.assign(1000000, "x");
         return c.Generate(r).status();
       }},
      {"max_new_tokens 2^31-1", "max_new_tokens",
       [&](client::Client& c) {
         return c.Generate(Ask({}, {5, 6}, 2147483647)).status();
       }},
      {"a 1 MiB document name", "max_name_bytes",
       [&](client::Client& c) {
         const std::vector<int32_t> ids = {1, 5, 6};
         return c.PutDocument(std::string(1 << 20, 'n'), nullptr, &ids).status();
       }},
      {"a 1 MiB request id", "max_id_bytes",
       [&](client::Client& c) { return c.Poll(std::string(1 << 20, 'r'), 0, 0).status(); }},
      {"wait_ms of a day", "wait_ms", [&](client::Client& c) { return c.Poll("req-0", 0, 86400000).status(); }},
  };
  // Once each, checked one by one.
  for (const Attack& a : attacks) {
    EXPECT_TRUE(RefusedNaming(a.send(*setup), a.limit)) << a.name;
  }
  {
    // A completion window of a year; a custom_id of 1 MiB.
    rpc::SubmitJobRequest j;
    rpc::JobItem it;
    it.custom_id = "a";
    it.request = Ask({}, {5, 6}, 4);
    j.items = {it};
    j.completion_window_s = 365 * 86400;
    EXPECT_TRUE(RefusedNaming(setup->SubmitJob(j).status(), "max_completion_window_s"));
    j.completion_window_s = 0;
    j.items[0].custom_id = std::string(1 << 20, 'c');
    EXPECT_TRUE(RefusedNaming(setup->SubmitJob(j).status(), "max_custom_id_bytes"));
  }

  // Now all of them from three clients at once for 6 s, while the victim asks.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> attacks_sent{0}, attacks_wrong{0};
  std::mutex wrong_mu;
  std::string first_wrong;
  std::vector<std::thread> attackers;
  for (int t = 0; t < 3; ++t) {
    attackers.emplace_back([&, t] {
      auto c = cluster.Client(attacker_key.key);
      if (!c) return;
      for (size_t i = t; !stop.load(); ++i) {
        const Attack& a = attacks[i % attacks.size()];
        ::testing::AssertionResult refused = RefusedNaming(a.send(*c), a.limit);
        if (!refused) {
          ++attacks_wrong;
          std::lock_guard<std::mutex> lk(wrong_mu);
          if (first_wrong.empty()) first_wrong = a.name + ": " + refused.message();
        }
        ++attacks_sent;
      }
    });
  }
  auto victim = cluster.Client(victim_key.key);
  ASSERT_TRUE(victim);
  int64_t served = 0, failed = 0;
  double worst_s = 0;
  std::string first_failure;
  const Clock::time_point until = Clock::now() + 6s;
  while (Clock::now() < until) {
    const Clock::time_point t0 = Clock::now();
    auto r = victim->Complete(Ask({}, LcgTokens(12, 100 + served + failed, true), 4));
    worst_s = std::max(worst_s, std::chrono::duration<double>(Clock::now() - t0).count());
    if (r.ok() && r->usage.generated_tokens == 4) {
      ++served;
    } else {
      if (first_failure.empty()) first_failure = r.ok() ? "short answer" : r.status().ToString();
      ++failed;
    }
  }
  stop = true;
  for (auto& t : attackers) t.join();
  const int64_t peak = PeakRss(cluster.coordinator().process->pid());
  std::printf(
      "flood: %lld attacks refused by 3 clients in 6 s; victim: %lld requests served, %lld failed, slowest "
      "%.3f s; coordinator peak RSS %.0f MiB\n",
      static_cast<long long>(attacks_sent.load()), static_cast<long long>(served), static_cast<long long>(failed),
      worst_s, peak / 1048576.0);
  EXPECT_EQ(attacks_wrong.load(), 0) << "an attack was not refused naming its limit: " << first_wrong;
  EXPECT_GE(attacks_sent.load(), static_cast<int64_t>(attacks.size())) << "the attackers barely ran";
  EXPECT_EQ(failed, 0) << "the victim's requests failed during the flood: " << first_failure;
  EXPECT_GE(served, 5) << "the victim was barely served during the flood";
  EXPECT_GT(peak, 0);
  EXPECT_LT(peak, int64_t{1} << 30) << "the coordinator's memory grew with the attack";
  // Still serving, the attacker's document intact.
  EXPECT_TRUE(cluster.coordinator().process->running());
  EXPECT_TRUE(cluster.worker(0).process->running());
  auto after = setup->Complete(Ask({doc_id}, {5, 6, 7}, 4));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->usage.cached_prompt_tokens, 100);
}

// A tenant of 100 generated tokens a minute asks for 15 generations of 100
// tokens at once (the issue's 1,500): one is admitted, the others wait
// (RESOURCE_EXHAUSTED, retry after about a minute); a generation of more
// than 100 can never be admitted (INVALID_ARGUMENT naming the quota), nor a
// job item of that size; the other tenant is not affected.
TEST_F(PublicApi, TheTokenQuotaIsReservedUpFront) {
  const Key metered_key, other_key;
  ClusterOptions o;
  o.tenants_yaml = "tenants:\n  - name: metered\n    api_keys: [" + metered_key.hash() +
                   "]\n    quotas:\n      generated_tokens_per_minute: 100\n  - name: other\n    api_keys: [" +
                   other_key.hash() + "]\n";
  Cluster cluster(o);
  ASSERT_TRUE(cluster.StartWorker(0));
  ASSERT_TRUE(cluster.StartCoordinator({"--data-dir", cluster.dir() + "/data"}));
  std::atomic<int64_t> generated{0}, ok{0}, waited{0}, other{0};
  std::atomic<int32_t> min_retry_ms{INT32_MAX};
  std::vector<std::thread> clients;
  const Clock::time_point t0 = Clock::now();
  for (int i = 0; i < 15; ++i) {
    clients.emplace_back([&, i] {
      auto c = cluster.Client(metered_key.key);
      if (!c) return;
      auto r = c->Complete(Ask({}, LcgTokens(8, 300 + i, true), 100));
      if (r.ok()) {
        ++ok;
        generated += r->usage.generated_tokens;
      } else if (r.status().code() == StatusCode::kResourceExhausted) {
        ++waited;
        int32_t cur = min_retry_ms.load();
        while (r.status().retry_after_ms() < cur &&
               !min_retry_ms.compare_exchange_weak(cur, r.status().retry_after_ms())) {
        }
      } else {
        ++other;
        ADD_FAILURE() << "request " << i << ": " << r.status();
      }
    });
  }
  for (auto& t : clients) t.join();
  const double elapsed_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf(
      "15 x 100 tokens at 100 a minute: %lld admitted, %lld told to wait (retry after >= %d ms), %lld "
      "tokens generated in %.1f s\n",
      static_cast<long long>(ok.load()), static_cast<long long>(waited.load()), min_retry_ms.load(),
      static_cast<long long>(generated.load()), elapsed_s);
  EXPECT_EQ(other.load(), 0);
  EXPECT_GE(ok.load(), 1);
  EXPECT_EQ(ok.load() + waited.load(), 15);
  // The bucket's 100 plus what refills meanwhile (100 a minute), never 1,500.
  EXPECT_LE(generated.load(), 100 + static_cast<int64_t>(elapsed_s * 100 / 60) + 1);
  EXPECT_GE(min_retry_ms.load(), 10000) << "a 100-token reservation refills in tens of seconds";
  // The coordinator's own count agrees.
  auto m = cluster.Client(metered_key.key);
  ASSERT_TRUE(m);
  auto stats = m->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->generated_tokens, generated.load());

  const Status never = m->Generate(Ask({}, LcgTokens(8, 400, true), 400)).status();
  EXPECT_TRUE(RefusedNaming(never, "generated_tokens_per_minute quota of 100"));
  rpc::SubmitJobRequest j;
  rpc::JobItem it;
  it.custom_id = "big";
  it.request = Ask({}, LcgTokens(8, 401, true), 400);
  j.items = {it};
  EXPECT_TRUE(RefusedNaming(m->SubmitJob(j).status(), "generated_tokens_per_minute quota of 100"));
  // The other tenant is unmetered and unaffected.
  auto o2 = cluster.Client(other_key.key);
  ASSERT_TRUE(o2);
  auto big = o2->Complete(Ask({}, LcgTokens(8, 402, true), 400));
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->usage.generated_tokens, 400);
}

// TLS everywhere. Tenant `secure` requires client certificate `client`:
// refused without a certificate, with another client's (same CA, role
// client), with the admin's, each with the message of a key that is not
// valid; served with its own. A tenant without the requirement is served
// with or without one.
TEST_F(PublicApi, ATenantThatRequiresAClientCertificateIsServedOnlyWithIt) {
  const Key secure_key, plain_key;
  ClusterOptions o;
  o.tls = true;
  o.tenants_yaml = "tenants:\n  - name: secure\n    api_keys: [" + secure_key.hash() +
                   "]\n    client_certificate: client\n  - name: plain\n    api_keys: [" + plain_key.hash() + "]\n";
  Cluster cluster(o);
  // Another client's certificate from the same CA.
  transport::CertificateSpec spec;
  spec.role = transport::role::kClient;
  spec.name = "client2";
  spec.hosts = {"127.0.0.1"};
  const std::string dir = cluster.certs_dir();
  ASSERT_TRUE(
      transport::IssueCertificate(dir + "/ca.pem", dir + "/ca.key", spec, dir + "/client2.pem", dir + "/client2.key")
          .ok());
  ASSERT_TRUE(cluster.Start());

  auto wrong = cluster.Client("key-that-is-not-valid-at-all");
  ASSERT_TRUE(wrong);
  const Status bad_key = wrong->ListDocuments().status();
  ASSERT_EQ(bad_key.code(), StatusCode::kPermissionDenied) << bad_key;
  for (const std::string& cert : {std::string(), std::string("client2"), std::string("admin")}) {
    SCOPED_TRACE("certificate '" + cert + "'");
    auto c = cluster.Client(secure_key.key, cert);
    ASSERT_TRUE(c);
    const Status s = c->Complete(Ask({}, LcgTokens(8, 500, true), 2)).status();
    EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s;
    EXPECT_EQ(s.message(), bad_key.message()) << "the refusal tells that the key was valid";
    EXPECT_EQ(c->ListDocuments().status().code(), StatusCode::kPermissionDenied);
  }
  auto good = cluster.Client(secure_key.key, "client");
  ASSERT_TRUE(good);
  auto r = good->Complete(Ask({}, LcgTokens(8, 501, true), 3));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->usage.generated_tokens, 3);
  for (const std::string& cert : {std::string(), std::string("client2")}) {
    auto c = cluster.Client(plain_key.key, cert);
    ASSERT_TRUE(c);
    auto p = c->Complete(Ask({}, LcgTokens(8, 502, true), 2));
    EXPECT_TRUE(p.ok()) << cert << ": " << p.status();
  }
}

// Health (no key) tells only whether the service serves and the model's
// name: no path, no host, no worker. Stats shows the workers to an admin
// tenant only.
TEST_F(PublicApi, HealthRevealsNoPathOrAddressAndOnlyAnAdminSeesTheWorkers) {
  const Key admin_key, user_key;
  ClusterOptions o;
  o.tenants_yaml = "tenants:\n  - name: ops\n    api_keys: [" + admin_key.hash() +
                   "]\n    admin: true\n  - name: user\n    api_keys: [" + user_key.hash() + "]\n";
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto anyone = cluster.Client();
  ASSERT_TRUE(anyone);
  auto h = anyone->Health();
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(h->serving);
  EXPECT_EQ(h->model, "stories260K");
  EXPECT_TRUE(h->workers.empty());
  // Nothing of the deployment anywhere in the reply's bytes.
  auto mem = std::make_shared<apache::thrift::transport::TMemoryBuffer>();
  apache::thrift::protocol::TBinaryProtocol p(mem);
  h->write(&p);
  const std::string bytes = mem->getBufferAsString();
  for (const std::string& secret : {cluster.model(), std::string("127.0.0.1"), std::to_string(cluster.worker(0).port),
                                    std::string("w0"), std::string("/")}) {
    EXPECT_EQ(bytes.find(secret), std::string::npos) << "Health reveals '" << secret << "'";
  }
  auto user = cluster.Client(user_key.key);
  ASSERT_TRUE(user);
  auto us = user->Stats();
  ASSERT_TRUE(us.ok()) << us.status();
  EXPECT_TRUE(us->workers.empty()) << "a tenant sees the workers";
  auto admin = cluster.Client(admin_key.key);
  ASSERT_TRUE(admin);
  auto as = admin->Stats();
  ASSERT_TRUE(as.ok()) << as.status();
  ASSERT_EQ(as->workers.size(), 1u);
  EXPECT_EQ(as->workers[0].name, "w0");
  EXPECT_EQ(as->workers[0].address, "127.0.0.1:" + std::to_string(cluster.worker(0).port));
  EXPECT_TRUE(as->workers[0].healthy);
}

// Request ids are "req-" and 32 hex digits (128 bits from the CSPRNG), all
// different; 2,000 guessed ids and another tenant's real ones find nothing
// (NOT_FOUND, as an id that never existed).
TEST_F(PublicApi, GuessedRequestIdsFindNothing) {
  const Key alice_key, mallory_key;
  ClusterOptions o;
  o.tenants_yaml = "tenants:\n  - name: alice\n    api_keys: [" + alice_key.hash() +
                   "]\n  - name: mallory\n    api_keys: [" + mallory_key.hash() + "]\n";
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto alice = cluster.Client(alice_key.key), mallory = cluster.Client(mallory_key.key);
  ASSERT_TRUE(alice && mallory);
  std::set<std::string> ids;
  for (int i = 0; i < 8; ++i) {
    auto id = alice->Generate(Ask({}, LcgTokens(8, 600 + i, true), 40));
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_EQ(id->size(), 4u + 32u) << *id;
    EXPECT_EQ(id->rfind("req-", 0), 0u) << *id;
    EXPECT_EQ(id->find_first_not_of("0123456789abcdef", 4), std::string::npos) << *id;
    EXPECT_TRUE(ids.insert(*id).second) << "an id came twice";
  }
  // Every pair differs in many of its 128 bits (not a counter).
  for (const std::string& a : ids) {
    for (const std::string& b : ids) {
      if (a == b) continue;
      int differ = 0;
      for (size_t k = 4; k < a.size(); ++k) differ += a[k] != b[k];
      EXPECT_GT(differ, 16) << a << " and " << b;
    }
  }
  for (const std::string& id : ids) {
    const Status poll = mallory->Poll(id, 0, 0).status();
    EXPECT_EQ(poll.code(), StatusCode::kNotFound) << poll;
    EXPECT_EQ(mallory->Cancel(id).code(), StatusCode::kNotFound);
  }
  int found = 0;
  for (int i = 0; i < 2000; ++i) {
    const std::string guess = "req-" + RandomHandle();
    const Status s = mallory->Poll(guess, 0, 0).status();
    found += s.code() != StatusCode::kNotFound;
  }
  EXPECT_EQ(found, 0);
  // Alice's own requests are hers, and end.
  for (const std::string& id : ids) {
    auto ch = alice->Poll(id, 0, 0);
    EXPECT_TRUE(ch.ok()) << ch.status();
    EXPECT_TRUE(alice->Cancel(id).ok());
  }
}

// One connection whose requests together pass the frame limit keeps being
// served (each frame is accounted alone): a long-lived client is not cut off
// after its first max_frame_bytes.
TEST_F(PublicApi, ALongLivedConnectionOutlivesTheFrameLimitInTotal) {
  ClusterOptions o;
  o.coordinator_flags = {"--max-frame-mb", "4"};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  for (int i = 0; i < 6; ++i) {
    rpc::GenerateRequest r = Ask({}, {5, 6}, 4);
    r.stop = {std::string(3 << 20, 's')};  // a 3 MiB string: 18 MiB in all
    EXPECT_TRUE(RefusedNaming(c->Generate(r).status(), "max_stop_string_bytes")) << "request " << i;
  }
  auto r = c->Complete(Ask({}, LcgTokens(8, 700, true), 3));
  ASSERT_TRUE(r.ok()) << r.status();
}

}  // namespace
}  // namespace penumbra::testing
