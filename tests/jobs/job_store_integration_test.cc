// JobStore under SIGKILL, with real processes and real files: a child
// process (this binary, re-executed) submits jobs, leases their items,
// records results (and duplicates of them), releases some leases and deletes
// finished jobs, all with synced writes, reporting each acknowledged change
// on a pipe. The parent kills it at a random moment, at least 50 times, and
// after every kill reopens the store and checks:
//  - every acknowledged job is visible, whole (every item, each spec exact),
//    unless its deletion may have been under way; an acknowledged deletion
//    is final;
//  - every acknowledged result is there exactly as recorded, a duplicate
//    never replaced it, and any other result is one the child produced;
//  - what an earlier check saw (jobs, results) is still there, unchanged;
//  - each item has at most one result, nothing is left running (the items
//    that were are pending again), and the counts equal a recount.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "coordinator/jobs/job_store.h"
#include "tests/crash_child.h"
#include "tests/storage/segment_store_test_util.h"

namespace penumbra::jobs {
namespace {

using storage::testing::TempDir;

const std::string kTenant = "tenant-a";

JobStoreOptions Durable(const std::string& path) {
  JobStoreOptions o;
  o.path = path;
  o.sync_writes = true;
  return o;
}

// Job n's items and results follow from (n, index, attempt), so the parent
// can check anything it finds.
JobSpec SpecFor(uint32_t n) {
  JobSpec s;
  const uint32_t items = 1 + n % 6;
  for (uint32_t i = 0; i < items; ++i) {
    JobItem item;
    item.custom_id = "item-" + std::to_string((i * 7 + n) % 10) + "-" + std::to_string(i);
    item.document_ids = {"doc-" + std::to_string(n % 11), "doc-" + std::to_string(i)};
    item.question = "question " + std::to_string(n) + "/" + std::to_string(i);
    item.options = std::string(1 + i, static_cast<char>(n));
    s.items.push_back(std::move(item));
  }
  s.metadata = std::to_string(n);
  return s;
}

ItemResult ResultFor(uint32_t n, uint32_t index, uint32_t attempt) {
  ItemResult r;
  r.ok = (n + index) % 5 != 0;
  (r.ok ? r.answer : r.error) = std::to_string(n) + " " + std::to_string(index) + " " + std::to_string(attempt);
  r.prompt_tokens = n;
  r.cached_tokens = index;
  r.generated_tokens = attempt;
  r.ttft_ms = n * 0.5 + index;
  return r;
}

ItemResult DuplicateResult() {
  ItemResult r;
  r.ok = true;
  r.answer = "duplicate";
  return r;
}

// One acknowledged change, as the child writes it to the pipe (one write of
// less than PIPE_BUF bytes: never split).
struct Ack {
  enum Kind : uint32_t { kSubmitted = 1, kCompleted = 2, kDuplicate = 3, kDeleted = 4 };
  uint32_t kind = 0;
  uint32_t n = 0;
  uint32_t index = 0;
  uint32_t attempt = 0;
  char job_id[24] = {};
};

// The child: runs only when re-executed by the crash test (environment
// PENUMBRA_JOBS_CRASH_DIR, _FD, _START). Submits jobs START, START+1, ...
// and works on every job in the store until killed.
TEST(JobStoreCrashChild, Run) {
  const char* dir = std::getenv("PENUMBRA_JOBS_CRASH_DIR");
  if (dir == nullptr) GTEST_SKIP() << "only run by JobStoreCrashTest";
  const int fd = std::atoi(std::getenv("PENUMBRA_JOBS_CRASH_FD"));
  uint32_t n = static_cast<uint32_t>(std::strtoul(std::getenv("PENUMBRA_JOBS_CRASH_START"), nullptr, 10));
  auto opened = JobStore::Open(Durable(dir));
  if (!opened.ok()) _exit(3);
  JobStore& s = **opened;
  std::mt19937_64 rng(n);
  std::map<std::string, uint32_t> number_of;  // job id -> n
  auto ack = [&](Ack::Kind kind, uint32_t job_n, uint32_t index, uint32_t attempt, const std::string& id) {
    Ack a;
    a.kind = kind;
    a.n = job_n;
    a.index = index;
    a.attempt = attempt;
    std::memcpy(a.job_id, id.data(), std::min(id.size(), sizeof(a.job_id) - 1));
    if (write(fd, &a, sizeof(a)) != sizeof(a)) _exit(5);
  };
  auto job_number = [&](const std::string& id) -> uint32_t {
    auto it = number_of.find(id);
    if (it != number_of.end()) return it->second;
    auto info = s.Get(kTenant, id);
    if (!info.ok()) _exit(6);
    return number_of[id] = static_cast<uint32_t>(std::stoul(info->metadata));
  };
  for (;; ++n) {
    auto id = s.Submit(kTenant, SpecFor(n));
    if (!id.ok()) _exit(4);
    number_of[*id] = n;
    ack(Ack::kSubmitted, n, 0, 0, *id);
    auto leases = s.Claim(1 + rng() % 8);
    if (!leases.ok()) _exit(7);
    for (const ItemLease& l : *leases) {
      const uint32_t ln = job_number(l.job_id);
      if (rng() % 8 == 0) {
        if (!s.Release(l.job_id, l.item_index, l.attempt).ok()) _exit(8);
        continue;
      }
      if (!s.Complete(l.job_id, l.item_index, l.attempt, ResultFor(ln, l.item_index, l.attempt)).ok()) _exit(9);
      ack(Ack::kCompleted, ln, l.item_index, l.attempt, l.job_id);
      if (rng() % 4 == 0) {
        if (!s.Complete(l.job_id, l.item_index, l.attempt, DuplicateResult()).ok()) _exit(10);
        ack(Ack::kDuplicate, ln, l.item_index, l.attempt, l.job_id);
      }
    }
    auto page = s.List(kTenant, "", kMaxPageSize);
    if (!page.ok()) _exit(11);
    for (const JobInfo& j : page->jobs) {
      if (j.status != JobStatus::kCompleted) continue;
      const uint32_t jn = job_number(j.id);
      if (!s.Delete(kTenant, j.id).ok()) _exit(12);
      ack(Ack::kDeleted, jn, 0, 0, j.id);
    }
  }
}

// What the parent knows of job n.
struct Tracked {
  std::string id;                               // once acknowledged or seen
  bool deleted = false;                         // deletion acknowledged
  bool gone = false;                            // seen absent (deleted, acknowledged or not)
  std::map<uint32_t, uint32_t> acked;           // index -> attempt of the acknowledged result
  std::map<uint32_t, ItemResult> seen_results;  // results an earlier check saw
};

TEST(JobStoreCrashTest, AcknowledgedJobsAndResultsSurviveSigkillExactlyOnce) {
  TempDir dir;
  std::mt19937_64 rng(20261125);
  std::map<uint32_t, Tracked> jobs;
  uint32_t next = 1;
  int64_t recoveries = 0, unacked_jobs_seen = 0, acked_results = 0, duplicates = 0;
  const auto t0 = std::chrono::steady_clock::now();
  constexpr int kKills = 50;
  // At least kKills kills, and more (up to kMaxKills) until a kill has left
  // leased items to recover: that case must be exercised, not hoped for.
  constexpr int kMaxKills = 150;
  int kills = 0;
  for (int kill_no = 0; kill_no < kKills || (recoveries == 0 && kill_no < kMaxKills); ++kill_no) {
    kills = kill_no + 1;
    SCOPED_TRACE("kill " + std::to_string(kill_no));
    int p[2] = {-1, -1};
    const pid_t pid = ::penumbra::testing::SpawnCrashChild(
        "JobStoreCrashChild.Run",
        {{"PENUMBRA_JOBS_CRASH_DIR", dir.path()}, {"PENUMBRA_JOBS_CRASH_START", std::to_string(next)}},
        "PENUMBRA_JOBS_CRASH_FD", &p[0]);
    ASSERT_GE(pid, 0);
    auto take = [&](const Ack& a) {
      Tracked& t = jobs[a.n];
      const std::string id(a.job_id);
      if (t.id.empty()) t.id = id;
      ASSERT_EQ(t.id, id) << "job " << a.n << " acknowledged under two ids";
      if (a.kind == Ack::kCompleted) {
        ASSERT_FALSE(t.acked.count(a.index)) << "job " << a.n << " item " << a.index << " completed twice";
        t.acked[a.index] = a.attempt;
        ++acked_results;
      }
      if (a.kind == Ack::kDuplicate) ++duplicates;
      if (a.kind == Ack::kDeleted) t.deleted = true;
    };
    // Kill inside the work loop, not during the child's start-up: wait for
    // its first acknowledgement, then a random moment.
    Ack a;
    ASSERT_EQ(read(p[0], &a, sizeof(a)), static_cast<ssize_t>(sizeof(a))) << "the child stopped before its first job";
    take(a);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 40000));
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "the child ended by itself (status " << status << ")";
    while (read(p[0], &a, sizeof(a)) == sizeof(a)) take(a);
    close(p[0]);
    if (HasFatalFailure()) return;

    auto opened = JobStore::Open(Durable(dir.path()));
    ASSERT_TRUE(opened.ok()) << opened.status();
    JobStore& s = **opened;
    recoveries += s.stats().recoveries;
    std::map<uint32_t, JobInfo> visible;
    std::string token;
    do {
      auto page = s.List(kTenant, token, 7);
      ASSERT_TRUE(page.ok()) << page.status();
      for (const JobInfo& j : page->jobs) {
        const uint32_t n = static_cast<uint32_t>(std::stoul(j.metadata));
        ASSERT_TRUE(visible.emplace(n, j).second) << "job " << n << " listed twice";
      }
      token = page->next_page_token;
    } while (!token.empty());

    for (auto& [n, t] : jobs) {
      if (visible.count(n)) continue;
      const size_t items = SpecFor(n).items.size();
      const bool all_finished_known = t.acked.size() + t.seen_results.size() >= items && [&, &t = t] {
        for (uint32_t i = 0; i < items; ++i) {
          if (!t.acked.count(i) && !t.seen_results.count(i)) return false;
        }
        return true;
      }();
      ASSERT_TRUE(t.deleted || t.gone || all_finished_known)
          << "acknowledged job " << n << " (" << t.id << ") is missing and was not being deleted";
      t.gone = true;
    }
    std::map<std::string, uint32_t> number_of;
    for (const auto& [n, info] : visible) {
      SCOPED_TRACE("job " + std::to_string(n));
      Tracked& t = jobs[n];
      ASSERT_FALSE(t.deleted) << "a deletion was acknowledged, yet the job is there";
      ASSERT_FALSE(t.gone) << "the job came back after it was gone";
      if (t.id.empty()) {
        t.id = info.id;  // stored, but the child was killed before acknowledging it
        ++unacked_jobs_seen;
      }
      ASSERT_EQ(info.id, t.id);
      number_of[info.id] = n;
      const JobSpec spec = SpecFor(n);
      ASSERT_EQ(info.counts.total, static_cast<int64_t>(spec.items.size()));
      ASSERT_EQ(info.counts.running, 0) << "an item was left running";
      ASSERT_TRUE(info.status == JobStatus::kInProgress || info.status == JobStatus::kCompleted)
          << ToString(info.status);
      // Results: each item once, each one the child produced.
      std::map<uint32_t, ItemOutcome> results;
      std::string after;
      do {
        auto page = s.Results(kTenant, info.id, after, 3);
        ASSERT_TRUE(page.ok()) << page.status();
        for (auto& o : page->items) {
          ASSERT_LT(o.item_index, spec.items.size());
          ASSERT_EQ(o.custom_id, spec.items[o.item_index].custom_id);
          const uint32_t index = o.item_index;
          ASSERT_TRUE(results.emplace(index, std::move(o)).second) << "item " << index << " has two results";
        }
        after = page->next_after_custom_id;
      } while (!after.empty());
      int64_t succeeded = 0, failed = 0;
      for (const auto& [index, o] : results) {
        const uint32_t attempt = static_cast<uint32_t>(o.result.generated_tokens);
        ASSERT_TRUE(o.result == ResultFor(n, index, attempt))
            << "item " << index << ": not a result the child recorded first: " << o.result.answer << o.result.error;
        ASSERT_EQ(o.state, o.result.ok ? ItemState::kSucceeded : ItemState::kFailed);
        if (auto k = t.acked.find(index); k != t.acked.end()) {
          ASSERT_EQ(attempt, k->second) << "item " << index << ": the acknowledged result was replaced";
        }
        if (auto k = t.seen_results.find(index); k != t.seen_results.end()) {
          ASSERT_TRUE(o.result == k->second) << "item " << index << ": a result changed after it was seen";
        }
        t.seen_results[index] = o.result;
        (o.result.ok ? succeeded : failed) += 1;
      }
      for (const auto& [index, attempt] : t.acked) {
        ASSERT_TRUE(results.count(index)) << "acknowledged result of item " << index << " is missing";
      }
      for (const auto& [index, r] : t.seen_results) {
        ASSERT_TRUE(results.count(index)) << "result of item " << index << " seen before is missing";
      }
      ASSERT_EQ(info.counts.completed, succeeded);
      ASSERT_EQ(info.counts.failed, failed);
      ASSERT_EQ(info.counts.cancelled, 0);
      ASSERT_EQ(info.counts.pending, info.counts.total - succeeded - failed);
      ASSERT_EQ(info.status == JobStatus::kCompleted, info.counts.pending == 0);
    }
    // Every unfinished item is there and whole: lease them all, check each,
    // and hand them back.
    auto leases = s.Claim(100000);
    ASSERT_TRUE(leases.ok()) << leases.status();
    std::map<uint32_t, int64_t> leased;
    for (const ItemLease& l : *leases) {
      ASSERT_TRUE(number_of.count(l.job_id)) << "leased an item of unlisted job " << l.job_id;
      const uint32_t n = number_of[l.job_id];
      const JobSpec spec = SpecFor(n);
      ASSERT_LT(l.item_index, spec.items.size());
      const JobItem& want = spec.items[l.item_index];
      ASSERT_EQ(l.custom_id, want.custom_id);
      ASSERT_EQ(l.document_ids, want.document_ids);
      ASSERT_EQ(l.question, want.question);
      ASSERT_EQ(l.options, want.options);
      ASSERT_GE(l.attempt, 1u);
      ASSERT_FALSE(jobs[n].seen_results.count(l.item_index)) << "a finished item was leased";
      ++leased[n];
      ASSERT_TRUE(s.Release(l.job_id, l.item_index, l.attempt).ok());
    }
    for (const auto& [n, info] : visible) ASSERT_EQ(leased[n], info.counts.pending) << "job " << n;
    ASSERT_EQ(s.stats().corrupt_records, 0);
    uint32_t max_n = next - 1;
    if (!jobs.empty()) max_n = std::max(max_n, jobs.rbegin()->first);
    next = max_n + 1;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  size_t acked_jobs = 0;
  for (const auto& [n, t] : jobs) acked_jobs += !t.id.empty();
  std::printf(
      "%d kills, %zu jobs, %lld acknowledged results, %lld duplicates, %lld leases recovered, "
      "%lld jobs stored but unacknowledged, %.1f s\n",
      kills, acked_jobs, static_cast<long long>(acked_results), static_cast<long long>(duplicates),
      static_cast<long long>(recoveries), static_cast<long long>(unacked_jobs_seen), seconds);
  EXPECT_GT(acked_jobs, static_cast<size_t>(kKills));
  EXPECT_GT(duplicates, 0);
  EXPECT_GT(recoveries, 0) << "no kill left a leased item: recovery was not exercised";
}

}  // namespace
}  // namespace penumbra::jobs
