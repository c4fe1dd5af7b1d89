// The durable DocumentRegistry under SIGKILL, with real processes and real
// files: a child process (this binary, re-executed) adds documents and
// readies most of them, fails some, leaves some factoring and removes
// readied ones (its own and those it found at Open), reporting on a pipe
// each SetReady and Remove before the call and again once it returned. The
// parent kills it at a random moment, at least 30 times, and after every
// kill reopens the registry and checks:
//  - every acknowledged SetReady is there, READY, no worker, with its exact
//    token ids and fields, unless a Remove of it was under way;
//  - an acknowledged Remove is final, and nothing else is there: only
//    documents a SetReady was called for (acknowledged or not), each under
//    the id it was added with;
//  - what an earlier check saw is still there unless a Remove was under way;
//    what it found missing never comes back;
//  - the counts per tenant equal the listing, and no record is damaged.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "coordinator/server/document_registry.h"
#include "tests/crash_child.h"
#include "tests/storage/segment_store_test_util.h"

namespace penumbra::coordinator {
namespace {

using storage::testing::TempDir;

constexpr int64_t kMaxPerTenant = 1 << 20;

// Document n's tenant, tokens and fields follow from n, so the parent can
// check anything it finds.
std::string TenantOf(uint32_t n) { return n % 3 == 0 ? "tenant-b" : "tenant-a"; }
std::string NameOf(uint32_t n) { return "n" + std::to_string(n); }
std::vector<int32_t> TokensOf(uint32_t n) {
  std::vector<int32_t> ids(1 + (n * 7919u) % 4000);
  uint32_t x = n * 2654435761u + 1;
  for (auto& t : ids) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    t = static_cast<int32_t>(x);
  }
  return ids;
}
int64_t LeadingSpecialOf(uint32_t n) { return n % 2; }
double FactorSecondsOf(uint32_t n) { return 0.5 * n + 0.25; }

// One report, as the child writes it to the pipe (one write of less than
// PIPE_BUF bytes: never split).
struct Report {
  enum Kind : uint32_t { kReadying = 1, kReady = 2, kRemoving = 3, kRemoved = 4 };
  uint32_t kind = 0;
  uint32_t n = 0;
  char id[24] = {};
};

// The child: runs only when re-executed by the crash test (environment
// PENUMBRA_DOCS_CRASH_DIR, _FD, _START). Adds documents START, START+1, ...
// until killed.
TEST(DocumentRegistryCrashChild, Run) {
  const char* dir = std::getenv("PENUMBRA_DOCS_CRASH_DIR");
  if (dir == nullptr) GTEST_SKIP() << "only run by DocumentRegistryCrashTest";
  const int fd = std::atoi(std::getenv("PENUMBRA_DOCS_CRASH_FD"));
  uint32_t n = static_cast<uint32_t>(std::strtoul(std::getenv("PENUMBRA_DOCS_CRASH_START"), nullptr, 10));
  auto opened = DocumentRegistry::Open(dir, kMaxPerTenant);
  if (!opened.ok()) _exit(3);
  DocumentRegistry& reg = **opened;
  // Seeded with the pid too: a child that reported nothing new does not
  // repeat its predecessor's run.
  std::mt19937_64 rng(n * 1000003ull + static_cast<uint64_t>(getpid()));
  std::vector<std::pair<uint32_t, std::string>> ready;  // (n, id), removable
  for (const char* t : {"tenant-a", "tenant-b"}) {
    auto page = reg.List(t, "", 1 << 20);
    if (!page.ok()) _exit(4);
    for (const DocumentView& d : page->documents) {
      ready.emplace_back(static_cast<uint32_t>(std::stoul(d.name.substr(1))), d.id);
    }
  }
  auto report = [&](Report::Kind kind, uint32_t dn, const std::string& id) {
    Report r;
    r.kind = kind;
    r.n = dn;
    std::memcpy(r.id, id.data(), std::min(id.size(), sizeof(r.id) - 1));
    if (write(fd, &r, sizeof(r)) != sizeof(r)) _exit(5);
  };
  for (;; ++n) {
    auto d = reg.Add(TenantOf(n), NameOf(n), TokensOf(n), LeadingSpecialOf(n));
    if (!d.ok()) _exit(6);
    const uint64_t fate = rng() % 10;
    if (fate == 0) {
      if (!reg.SetFailed(d->id, Status::Internal("the worker ended the put")).ok()) _exit(9);
    } else if (fate == 1) {
      // left factoring
    } else {
      report(Report::kReadying, n, d->id);
      if (!reg.SetReady(d->id, static_cast<int>(n % 4), FactorSecondsOf(n)).ok()) _exit(9);
      report(Report::kReady, n, d->id);
      ready.emplace_back(n, d->id);
    }
    if (!ready.empty() && rng() % 3 == 0) {
      const size_t k = rng() % ready.size();
      const auto [rn, id] = ready[k];
      ready.erase(ready.begin() + static_cast<std::ptrdiff_t>(k));
      report(Report::kRemoving, rn, id);
      if (!reg.Remove(TenantOf(rn), id).ok()) _exit(7);
      report(Report::kRemoved, rn, id);
    }
    if (reg.persist_errors() != 0) _exit(8);
  }
}

// What the parent knows of document n.
struct Tracked {
  std::string id;
  bool readying = false;  // SetReady called
  bool ready = false;     // SetReady returned
  bool removing = false;  // Remove called
  bool removed = false;   // Remove returned
  bool seen = false;      // an earlier check found it
  bool gone = false;      // an earlier check found it missing
};

TEST(DocumentRegistryCrashTest, AcknowledgedDocumentsSurviveSigkill) {
  TempDir dir;
  std::mt19937_64 rng(20261125);
  std::map<uint32_t, Tracked> docs;
  uint32_t next = 1;
  int64_t acked_ready = 0, acked_removed = 0, in_flight_kills = 0, unacked_seen = 0;
  const auto t0 = std::chrono::steady_clock::now();
  constexpr int kKills = 30;
  // At least kKills kills, and more (up to kMaxKills) until some kill has
  // landed inside a SetReady or Remove: that case must be exercised.
  constexpr int kMaxKills = 90;
  int kills = 0;
  for (int kill_no = 0; kill_no < kKills || (in_flight_kills == 0 && kill_no < kMaxKills); ++kill_no) {
    kills = kill_no + 1;
    SCOPED_TRACE("kill " + std::to_string(kill_no));
    int p[2] = {-1, -1};
    const pid_t pid = ::penumbra::testing::SpawnCrashChild(
        "DocumentRegistryCrashChild.Run",
        {{"PENUMBRA_DOCS_CRASH_DIR", dir.path()}, {"PENUMBRA_DOCS_CRASH_START", std::to_string(next)}},
        "PENUMBRA_DOCS_CRASH_FD", &p[0]);
    ASSERT_GE(pid, 0);
    Report last;
    auto take = [&](const Report& r) {
      Tracked& t = docs[r.n];
      const std::string id(r.id);
      if (t.id.empty()) t.id = id;
      ASSERT_EQ(t.id, id) << "document " << r.n << " reported under two ids";
      switch (r.kind) {
        case Report::kReadying:
          t.readying = true;
          break;
        case Report::kReady:
          t.ready = true;
          ++acked_ready;
          break;
        case Report::kRemoving:
          t.removing = true;
          break;
        case Report::kRemoved:
          t.removed = true;
          ++acked_removed;
          break;
        default:
          FAIL() << "report of kind " << r.kind;
      }
      last = r;
    };
    // Kill inside the work loop, not during the child's start-up: wait for
    // its first report, then a random moment.
    Report r;
    ASSERT_EQ(read(p[0], &r, sizeof(r)), static_cast<ssize_t>(sizeof(r)))
        << "the child stopped before its first report";
    take(r);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 60000));
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "the child ended by itself (status " << status << ")";
    while (read(p[0], &r, sizeof(r)) == sizeof(r)) take(r);
    close(p[0]);
    if (HasFatalFailure()) return;
    in_flight_kills += last.kind == Report::kReadying || last.kind == Report::kRemoving;

    auto opened = DocumentRegistry::Open(dir.path(), kMaxPerTenant);
    ASSERT_TRUE(opened.ok()) << opened.status();
    DocumentRegistry& reg = **opened;
    ASSERT_EQ(reg.corrupt_records(), 0);
    std::map<uint32_t, DocumentView> present;
    for (const char* tenant : {"tenant-a", "tenant-b"}) {
      int64_t listed = 0;
      std::string token;
      do {
        auto page = reg.List(tenant, token, 50);
        ASSERT_TRUE(page.ok()) << page.status();
        for (DocumentView& d : page->documents) {
          ASSERT_EQ(d.name.rfind('n', 0), 0u) << "a document named " << d.name;
          const uint32_t n = static_cast<uint32_t>(std::stoul(d.name.substr(1)));
          ASSERT_EQ(d.tenant, tenant);
          ASSERT_TRUE(present.emplace(n, std::move(d)).second) << "document " << n << " listed twice";
          ++listed;
        }
        token = page->next_page_token;
      } while (!token.empty());
      ASSERT_EQ(reg.count(tenant), listed);
    }
    ASSERT_EQ(reg.count(), static_cast<int64_t>(present.size()));
    for (const auto& [n, d] : present) {
      SCOPED_TRACE("document " + std::to_string(n) + " " + d.id);
      auto it = docs.find(n);
      ASSERT_TRUE(it != docs.end() && it->second.readying) << "stored, but SetReady was never called for it";
      Tracked& t = it->second;
      ASSERT_EQ(d.id, t.id);
      ASSERT_FALSE(t.removed) << "its Remove was acknowledged, yet it is there";
      ASSERT_FALSE(t.gone) << "it came back after a check found it missing";
      ASSERT_EQ(d.tenant, TenantOf(n));
      ASSERT_EQ(d.state, DocumentState::kReady);
      ASSERT_TRUE(d.workers.empty());
      ASSERT_EQ(*d.ids, TokensOf(n));
      ASSERT_EQ(d.tokens, static_cast<int64_t>(d.ids->size()));
      ASSERT_EQ(d.factored_tokens, d.tokens);
      ASSERT_EQ(d.leading_special, LeadingSpecialOf(n));
      ASSERT_EQ(d.factor_seconds, FactorSecondsOf(n));
      ASSERT_GT(d.created_unix_ms, 0);
      unacked_seen += !t.ready && !t.seen;
      t.seen = true;
      t.removing = false;  // survived its Remove's crash: the next child may remove it again
    }
    for (auto& [n, t] : docs) {
      if (present.count(n)) continue;
      if (!t.removing && !t.removed) {
        ASSERT_FALSE(t.ready) << "document " << n << " (" << t.id << "): its SetReady was acknowledged, it is missing";
        ASSERT_FALSE(t.seen) << "document " << n << " (" << t.id << "): an earlier check found it, it is missing";
      }
      t.gone = true;
    }
    // Numbers the child used without reporting them (failed, left factoring,
    // or killed before SetReady) were never stored: the next child may reuse them.
    if (!docs.empty()) next = std::max(next, docs.rbegin()->first + 1);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "%d kills (%lld inside a SetReady or Remove), %lld acknowledged SetReady, %lld acknowledged Remove, "
      "%lld stored but unacknowledged, %.1f s\n",
      kills, static_cast<long long>(in_flight_kills), static_cast<long long>(acked_ready),
      static_cast<long long>(acked_removed), static_cast<long long>(unacked_seen), seconds);
  EXPECT_GT(acked_ready, kKills);
  EXPECT_GT(acked_removed, 0);
  EXPECT_GT(in_flight_kills, 0) << "no kill landed inside a SetReady or Remove";
}

}  // namespace
}  // namespace penumbra::coordinator
