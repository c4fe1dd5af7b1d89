// JobStore on real RocksDB: a model-based test (random submit / claim /
// complete, duplicate and stale results included / release / cancel / expire
// on a fake clock / delete / reopen, against a plain in-memory model, with
// every tenant's jobs, results and counts compared after every step), then
// the lifecycle of one job step by step, validation errors that name the
// item, tenant isolation, paging, ids that never repeat, recovery at reopen,
// and damaged records reported as Corruption.
#include "coordinator/jobs/job_store.h"

#include <algorithm>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "tests/storage/segment_store_test_util.h"

namespace penumbra::jobs {
namespace {

using storage::testing::TempDir;

// A store on a fake clock (seconds, advanced by the test).
JobStoreOptions Options(const std::string& path, const int64_t* now) {
  JobStoreOptions o;
  o.path = path;
  o.sync_writes = false;  // the crash test checks durability with syncs on
  o.default_completion_window_s = 5000;
  o.clock = [now] { return *now; };
  return o;
}

std::unique_ptr<JobStore> OpenOrDie(const JobStoreOptions& o) {
  auto s = JobStore::Open(o);
  CHECK(s.ok()) << s.status();
  return std::move(*s);
}

JobItem Item(std::string custom_id, std::string question = "what?") {
  JobItem i;
  i.custom_id = std::move(custom_id);
  i.document_ids = {"doc-1", "doc-2"};
  i.question = std::move(question);
  i.options = std::string("{\"t\":0.5}\0raw", 13);  // opaque bytes, a NUL among them
  return i;
}

JobSpec Spec(std::vector<std::string> custom_ids, int64_t window_s = 0) {
  JobSpec s;
  for (auto& id : custom_ids) s.items.push_back(Item(id));
  s.completion_window_s = window_s;
  s.metadata = "meta";
  return s;
}

ItemResult Answer(const std::string& text, bool ok = true) {
  ItemResult r;
  r.ok = ok;
  (ok ? r.answer : r.error) = text;
  r.prompt_tokens = 100;
  r.cached_tokens = 60;
  r.generated_tokens = 7;
  r.ttft_ms = 12.5;
  return r;
}

std::string Describe(const JobInfo& i) {
  std::ostringstream os;
  os << i.id << " tenant=" << i.tenant << " " << ToString(i.status) << " created=" << i.created_at
     << " window=" << i.completion_window_s << " expires=" << i.expires_at << " finished=" << i.finished_at
     << " metadata=" << i.metadata << " counts{total=" << i.counts.total << " pending=" << i.counts.pending
     << " running=" << i.counts.running << " completed=" << i.counts.completed << " failed=" << i.counts.failed
     << " cancelled=" << i.counts.cancelled << "} damage=" << i.damage;
  return os.str();
}
std::string Describe(const ItemResult& r) {
  std::ostringstream os;
  os << (r.ok ? "ok" : "error") << " answer=" << r.answer << " error=" << r.error << " tokens=" << r.prompt_tokens
     << "/" << r.cached_tokens << "/" << r.generated_tokens << " ttft=" << r.ttft_ms;
  return os.str();
}
std::string Describe(const ItemOutcome& o) {
  return o.custom_id + " #" + std::to_string(o.item_index) + " " + std::string(ToString(o.state)) + " " +
         Describe(o.result);
}
std::string Describe(const ItemLease& l) {
  std::ostringstream os;
  os << l.job_id << " tenant=" << l.tenant << " #" << l.item_index << " " << l.custom_id << " attempt=" << l.attempt
     << " question=" << l.question << " options=" << l.options << " docs=";
  for (const auto& d : l.document_ids) os << d << ",";
  return os.str();
}
template <class T>
std::vector<std::string> DescribeAll(const std::vector<T>& v) {
  std::vector<std::string> out;
  for (const auto& x : v) out.push_back(Describe(x));
  return out;
}

bool Finished(ItemState s) {
  return s == ItemState::kSucceeded || s == ItemState::kFailed || s == ItemState::kCancelled;
}

// All of a tenant's jobs, through List pages of `page_size`.
std::vector<JobInfo> ListAll(const JobStore& s, const std::string& tenant, size_t page_size) {
  std::vector<JobInfo> all;
  std::string token;
  for (int pages = 0;; ++pages) {
    auto page = s.List(tenant, token, page_size);
    CHECK(page.ok()) << page.status();
    CHECK(pages < 10000) << "List does not end";
    if (!page->next_page_token.empty()) {
      EXPECT_EQ(page->jobs.size(), page_size) << "a page before the last is short";
      EXPECT_EQ(page->next_page_token, page->jobs.back().id);
    }
    for (auto& j : page->jobs) all.push_back(std::move(j));
    if (page->next_page_token.empty()) return all;
    token = page->next_page_token;
  }
}

// All of a job's results, through pages of `page_size`.
Result<std::vector<ItemOutcome>> ResultsAll(JobStore& s, const std::string& tenant, const std::string& id,
                                            size_t page_size) {
  std::vector<ItemOutcome> all;
  std::string after;
  for (;;) {
    auto page = s.Results(tenant, id, after, page_size);
    if (!page.ok()) return page.status();
    if (!page->next_after_custom_id.empty()) {
      EXPECT_EQ(page->items.size(), page_size) << "a results page before the last is short";
      EXPECT_EQ(page->next_after_custom_id, page->items.back().custom_id);
    }
    for (auto& o : page->items) all.push_back(std::move(o));
    if (page->next_after_custom_id.empty()) return all;
    after = page->next_after_custom_id;
  }
}

// ---- the model: what the store must hold, kept plainly ------------------------
struct Model {
  struct MItem {
    JobItem spec;
    ItemState state = ItemState::kPending;
    uint32_t attempt = 0;
    ItemResult result;
  };
  struct MJob {
    std::string id, tenant, metadata;
    JobStatus status = JobStatus::kInProgress;
    int64_t created_at = 0, window = 0, finished_at = 0;
    std::vector<MItem> items;
  };
  std::vector<MJob> jobs;  // in creation order
  JobStoreStats stats;

  MJob* Find(const std::string& id) {
    for (auto& j : jobs) {
      if (j.id == id) return &j;
    }
    return nullptr;
  }
  MJob* Find(const std::string& tenant, const std::string& id) {
    MJob* j = Find(id);
    return j && j->tenant == tenant ? j : nullptr;
  }
  static int Count(const MJob& j, ItemState s) {
    int n = 0;
    for (const auto& i : j.items) n += i.state == s;
    return n;
  }
  // A job with nothing left to run is finished.
  static void Settle(MJob& j, int64_t now) {
    const int pending = Count(j, ItemState::kPending), running = Count(j, ItemState::kRunning);
    if (j.status == JobStatus::kInProgress && pending == 0 && running == 0) {
      j.status = JobStatus::kCompleted;
      j.finished_at = now;
    } else if (j.status == JobStatus::kCancelling && running == 0) {
      j.status = JobStatus::kCancelled;
      j.finished_at = now;
    }
  }
  static ItemResult Error(const std::string& e) {
    ItemResult r;
    r.error = e;
    return r;
  }

  JobInfo Info(const MJob& j) const {
    JobInfo i;
    i.id = j.id;
    i.tenant = j.tenant;
    i.status = j.status;
    i.created_at = j.created_at;
    i.completion_window_s = j.window;
    i.expires_at = j.created_at + j.window;
    i.finished_at = j.finished_at;
    i.metadata = j.metadata;
    i.counts.total = static_cast<int64_t>(j.items.size());
    i.counts.pending = Count(j, ItemState::kPending);
    i.counts.running = Count(j, ItemState::kRunning);
    i.counts.completed = Count(j, ItemState::kSucceeded);
    i.counts.failed = Count(j, ItemState::kFailed);
    i.counts.cancelled = Count(j, ItemState::kCancelled);
    return i;
  }
  std::vector<ItemOutcome> Outcomes(const MJob& j) const {
    std::vector<ItemOutcome> out;
    for (uint32_t i = 0; i < j.items.size(); ++i) {
      const MItem& item = j.items[i];
      if (Finished(item.state)) out.push_back({item.spec.custom_id, i, item.state, item.result});
    }
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.custom_id < b.custom_id; });
    return out;
  }

  void Submit(const std::string& id, const std::string& tenant, const JobSpec& spec, int64_t now,
              int64_t default_window) {
    MJob j;
    j.id = id;
    j.tenant = tenant;
    j.metadata = spec.metadata;
    j.created_at = now;
    j.window = spec.completion_window_s > 0 ? spec.completion_window_s : default_window;
    for (const auto& item : spec.items) j.items.push_back({item, ItemState::kPending, 0, {}});
    jobs.push_back(std::move(j));
    ++stats.submits;
  }
  std::vector<ItemLease> Claim(size_t max_items) {
    std::vector<ItemLease> out;
    for (auto& j : jobs) {
      if (j.status != JobStatus::kInProgress) continue;
      for (uint32_t i = 0; i < j.items.size() && out.size() < max_items; ++i) {
        MItem& item = j.items[i];
        if (item.state != ItemState::kPending) continue;
        item.state = ItemState::kRunning;
        ++item.attempt;
        out.push_back({j.id, j.tenant, i, item.spec.custom_id, item.attempt, item.spec.document_ids, item.spec.question,
                       item.spec.options});
      }
    }
    stats.items_claimed += static_cast<int64_t>(out.size());
    return out;
  }
  StatusCode Complete(const std::string& id, uint32_t index, uint32_t attempt, const ItemResult& r, int64_t now) {
    MJob* j = Find(id);
    if (!j || index >= j->items.size()) return StatusCode::kNotFound;
    MItem& item = j->items[index];
    if (attempt == 0 || attempt > item.attempt) return StatusCode::kInvalidArgument;
    if (Finished(item.state)) {
      ++stats.duplicate_results_ignored;
      return StatusCode::kOk;
    }
    item.state = r.ok ? ItemState::kSucceeded : ItemState::kFailed;
    item.result = r;
    Settle(*j, now);
    ++stats.results_recorded;
    return StatusCode::kOk;
  }
  StatusCode Release(const std::string& id, uint32_t index, uint32_t attempt, int64_t now) {
    MJob* j = Find(id);
    if (!j || index >= j->items.size()) return StatusCode::kNotFound;
    MItem& item = j->items[index];
    if (item.state != ItemState::kRunning || item.attempt != attempt) {
      ++stats.stale_releases_ignored;
      return StatusCode::kOk;
    }
    if (j->status == JobStatus::kCancelling) {
      item.state = ItemState::kCancelled;
      item.result = Error("cancelled");
    } else {
      item.state = ItemState::kPending;
    }
    Settle(*j, now);
    ++stats.releases;
    return StatusCode::kOk;
  }
  StatusCode Cancel(const std::string& tenant, const std::string& id, int64_t now) {
    MJob* j = Find(tenant, id);
    if (!j) return StatusCode::kNotFound;
    if (j->status == JobStatus::kCancelling) return StatusCode::kOk;
    if (j->status != JobStatus::kInProgress) return StatusCode::kFailedPrecondition;
    for (auto& item : j->items) {
      if (item.state == ItemState::kPending) {
        item.state = ItemState::kCancelled;
        item.result = Error("cancelled");
      }
    }
    j->status = JobStatus::kCancelling;
    Settle(*j, now);
    ++stats.cancels;
    return StatusCode::kOk;
  }
  void Expire(int64_t now) {
    for (auto& j : jobs) {
      if (now < j.created_at + j.window) continue;
      if (j.status == JobStatus::kInProgress) {
        for (auto& item : j.items) {
          if (item.state == ItemState::kPending || item.state == ItemState::kRunning) {
            item.state = ItemState::kFailed;
            item.result = Error("expired");
          }
        }
        j.status = JobStatus::kExpired;
        j.finished_at = now;
        ++stats.jobs_expired;
      } else if (j.status == JobStatus::kCancelling) {
        for (auto& item : j.items) {
          if (item.state == ItemState::kRunning) {
            item.state = ItemState::kCancelled;
            item.result = Error("cancelled");
          }
        }
        Settle(j, now);
      }
    }
  }
  StatusCode Delete(const std::string& tenant, const std::string& id) {
    MJob* j = Find(tenant, id);
    if (!j) return StatusCode::kNotFound;
    if (j->status == JobStatus::kInProgress || j->status == JobStatus::kCancelling) {
      return StatusCode::kFailedPrecondition;
    }
    jobs.erase(jobs.begin() + (j - jobs.data()));
    ++stats.deletes;
    return StatusCode::kOk;
  }
  // The recovery rule: nothing runs after a restart.
  void Reopen(int64_t now) {
    stats = {};
    for (auto& j : jobs) {
      for (auto& item : j.items) {
        if (item.state != ItemState::kRunning) continue;
        ++stats.recoveries;
        if (j.status == JobStatus::kCancelling) {
          item.state = ItemState::kCancelled;
          item.result = Error("cancelled");
        } else {
          item.state = ItemState::kPending;
        }
      }
      Settle(j, now);
    }
  }
};

const std::vector<std::string> kTenants = {"acme", "beta", "gamma"};

JobSpec RandomSpec(std::mt19937_64& rng) {
  JobSpec s;
  const size_t n = 1 + rng() % 8;
  std::set<std::string> used;
  while (s.items.size() < n) {
    std::string id;
    for (size_t k = 0, len = 1 + rng() % 4; k < len; ++k) id.push_back("abxyz019"[rng() % 8]);
    if (!used.insert(id).second) continue;
    JobItem item;
    item.custom_id = id;
    for (size_t d = 0, nd = rng() % 4; d < nd; ++d) item.document_ids.push_back("doc-" + std::to_string(rng() % 50));
    item.question = "question " + std::to_string(rng() % 1000);
    item.options = std::string(1 + rng() % 3, static_cast<char>(rng() % 256));
    s.items.push_back(std::move(item));
  }
  const int64_t windows[] = {0, 40, 300, 1500};
  s.completion_window_s = windows[rng() % 4];
  if (rng() % 2) s.metadata = "batch " + std::to_string(rng() % 100);
  return s;
}

ItemResult RandomResult(std::mt19937_64& rng) {
  ItemResult r;
  r.ok = rng() % 4 != 0;
  (r.ok ? r.answer : r.error) = "text " + std::to_string(rng() % 100000);
  r.prompt_tokens = static_cast<int64_t>(rng() % 5000);
  r.cached_tokens = static_cast<int64_t>(rng() % 5000);
  r.generated_tokens = static_cast<int64_t>(rng() % 500);
  r.ttft_ms = static_cast<double>(rng() % 100000) / 7.0;
  return r;
}

struct RunTally {
  int reopens = 0, duplicates = 0, stale_releases = 0, expired = 0, cancelled = 0, deleted = 0, recovered = 0;
  int completed_jobs = 0;
};

// One random run of `steps` operations; the store and the model are compared after each.
void RunModel(uint64_t seed, int steps, RunTally* tally) {
  TempDir dir;
  int64_t now = 1'700'000'000;
  const JobStoreOptions o = Options(dir.path(), &now);
  std::unique_ptr<JobStore> s = OpenOrDie(o);
  Model m;
  std::mt19937_64 rng(seed);
  std::vector<ItemLease> leases;   // handed out, some already completed (for duplicates)
  std::set<std::string> ids_seen;  // every id the store ever returned

  auto compare = [&](int step) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " step " + std::to_string(step));
    for (const std::string& tenant : kTenants) {
      std::vector<std::string> want;
      for (const auto& j : m.jobs) {
        if (j.tenant == tenant) want.push_back(Describe(m.Info(j)));
      }
      ASSERT_EQ(DescribeAll(ListAll(*s, tenant, 1 + rng() % 4)), want) << "tenant " << tenant;
    }
    for (const auto& j : m.jobs) {
      auto got = s->Get(j.tenant, j.id);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(Describe(*got), Describe(m.Info(j)));
      const auto owner = std::find(kTenants.begin(), kTenants.end(), j.tenant) - kTenants.begin();
      const std::string& other = kTenants[(owner + 1) % 3];
      ASSERT_EQ(s->Get(other, j.id).status().code(), StatusCode::kNotFound);
      auto results = ResultsAll(*s, j.tenant, j.id, 1 + rng() % 5);
      ASSERT_TRUE(results.ok()) << results.status();
      ASSERT_EQ(DescribeAll(*results), DescribeAll(m.Outcomes(j))) << j.id;
    }
    const JobStoreStats a = s->stats(), b = m.stats;
    EXPECT_EQ(a.submits, b.submits);
    EXPECT_EQ(a.items_claimed, b.items_claimed);
    EXPECT_EQ(a.results_recorded, b.results_recorded);
    EXPECT_EQ(a.duplicate_results_ignored, b.duplicate_results_ignored);
    EXPECT_EQ(a.releases, b.releases);
    EXPECT_EQ(a.stale_releases_ignored, b.stale_releases_ignored);
    EXPECT_EQ(a.cancels, b.cancels);
    EXPECT_EQ(a.jobs_expired, b.jobs_expired);
    EXPECT_EQ(a.deletes, b.deletes);
    EXPECT_EQ(a.recoveries, b.recoveries);
    EXPECT_EQ(a.corrupt_records, 0);
  };
  // A job of the model, or one that does not exist (a made-up id).
  auto pick_job = [&]() -> std::pair<std::string, std::string> {
    if (m.jobs.empty() || rng() % 10 == 0) {
      return {kTenants[rng() % 3], "job-00000000000000" + std::to_string(rng() % 90 + 10)};
    }
    const Model::MJob& j = m.jobs[rng() % m.jobs.size()];
    return {rng() % 8 == 0 ? kTenants[rng() % 3] : j.tenant, j.id};
  };

  for (int step = 0; step < steps; ++step) {
    now += static_cast<int64_t>(rng() % 25);
    const int op = static_cast<int>(rng() % 100);
    if (op < 14) {  // submit
      if (m.jobs.size() >= 25) continue;
      const std::string& tenant = kTenants[rng() % 3];
      const JobSpec spec = RandomSpec(rng);
      auto id = s->Submit(tenant, spec);
      ASSERT_TRUE(id.ok()) << id.status();
      ASSERT_TRUE(ids_seen.insert(*id).second) << "job id " << *id << " repeated";
      m.Submit(*id, tenant, spec, now, o.default_completion_window_s);
    } else if (op < 30) {  // claim
      const size_t max_items = rng() % 7;
      auto got = s->Claim(max_items);
      ASSERT_TRUE(got.ok()) << got.status();
      const auto want = m.Claim(max_items);
      ASSERT_EQ(DescribeAll(*got), DescribeAll(want)) << "step " << step;
      for (const auto& l : want) leases.push_back(l);
      if (leases.size() > 60) leases.erase(leases.begin(), leases.begin() + 20);
    } else if (op < 55) {  // complete: a lease (its attempt, or a stale or unleased one), or a made-up item
      std::string id;
      uint32_t index = 0, attempt = 0;
      if (!leases.empty() && rng() % 8 != 0) {
        const size_t k = rng() % leases.size();
        id = leases[k].job_id;
        index = leases[k].item_index;
        attempt = leases[k].attempt;
        const int twist = static_cast<int>(rng() % 10);
        if (twist == 0) attempt += 1;                                             // never leased
        if (twist == 1) attempt = 0;                                              // never leased
        if (rng() % 3 != 0) leases.erase(leases.begin() + static_cast<long>(k));  // else kept for a duplicate
      } else {
        id = pick_job().second;
        index = static_cast<uint32_t>(rng() % 9);
        attempt = static_cast<uint32_t>(rng() % 3);
      }
      const ItemResult r = RandomResult(rng);
      const int64_t dups = m.stats.duplicate_results_ignored;
      const StatusCode want = m.Complete(id, index, attempt, r, now);
      const Status st = s->Complete(id, index, attempt, r);
      ASSERT_EQ(st.code(), want) << "step " << step << ": " << st;
      tally->duplicates += m.stats.duplicate_results_ignored > dups;
    } else if (op < 63) {  // release: a lease, sometimes stale
      if (leases.empty()) continue;
      const size_t k = rng() % leases.size();
      const ItemLease l = leases[k];
      leases.erase(leases.begin() + static_cast<long>(k));
      const int64_t stale = m.stats.stale_releases_ignored;
      const StatusCode want = m.Release(l.job_id, l.item_index, l.attempt, now);
      const Status st = s->Release(l.job_id, l.item_index, l.attempt);
      ASSERT_EQ(st.code(), want) << "step " << step << ": " << st;
      tally->stale_releases += m.stats.stale_releases_ignored > stale;
    } else if (op < 70) {  // cancel
      const auto [tenant, id] = pick_job();
      const StatusCode want = m.Cancel(tenant, id, now);
      const Status st = s->Cancel(tenant, id);
      ASSERT_EQ(st.code(), want) << "step " << step << ": " << st;
      tally->cancelled += want == StatusCode::kOk;
    } else if (op < 76) {  // expire
      const int64_t before = m.stats.jobs_expired;
      m.Expire(now);
      ASSERT_TRUE(s->ExpireDue(now).ok());
      tally->expired += static_cast<int>(m.stats.jobs_expired - before);
    } else if (op < 90) {  // delete: finished jobs mostly
      std::pair<std::string, std::string> pick = pick_job();
      for (const auto& j : m.jobs) {
        if (j.status == JobStatus::kCompleted && rng() % 2) pick = {j.tenant, j.id};
      }
      if (const Model::MJob* j = m.Find(pick.first, pick.second); j && j->status == JobStatus::kCompleted) {
        ++tally->completed_jobs;
      }
      const StatusCode want = m.Delete(pick.first, pick.second);
      const Status st = s->Delete(pick.first, pick.second);
      ASSERT_EQ(st.code(), want) << "step " << step << ": " << st;
      tally->deleted += want == StatusCode::kOk;
    } else if (op < 93) {  // close and reopen
      ++tally->reopens;
      s.reset();
      s = OpenOrDie(o);
      m.Reopen(now);  // the stats start again at zero
      tally->recovered += static_cast<int>(m.stats.recoveries);
    } else {  // requests for what does not exist, or is another tenant's
      const auto [tenant, id] = pick_job();
      const Model::MJob* j = m.Find(tenant, id);
      ASSERT_EQ(s->Get(tenant, id).ok(), j != nullptr);
      if (!j) {
        ASSERT_EQ(s->Get(tenant, id).status().code(), StatusCode::kNotFound);
        ASSERT_EQ(s->Results(tenant, id, "", 10).status().code(), StatusCode::kNotFound);
      }
    }
    compare(step);
    if (::testing::Test::HasFatalFailure() || ::testing::Test::HasFailure()) return;
  }
}

TEST(JobStoreTest, ModelBasedRandomOperationsAndReopens) {
  RunTally tally;
  for (uint64_t seed : {1, 2, 3, 4}) {
    RunModel(seed, 900, &tally);
    if (HasFailure()) return;
  }
  // The runs exercised what they are meant to.
  EXPECT_GT(tally.reopens, 20);
  EXPECT_GT(tally.recovered, 10);
  EXPECT_GT(tally.duplicates, 20);
  EXPECT_GT(tally.stale_releases, 10);
  EXPECT_GT(tally.expired, 5);
  EXPECT_GT(tally.cancelled, 10);
  EXPECT_GT(tally.deleted, 20);
  EXPECT_GT(tally.completed_jobs, 10);
  std::printf(
      "reopens %d, items recovered %d, duplicates %d, stale releases %d, expired %d, cancelled %d, "
      "deleted %d\n",
      tally.reopens, tally.recovered, tally.duplicates, tally.stale_releases, tally.expired, tally.cancelled,
      tally.deleted);
}

TEST(JobStoreTest, LifecycleOfAJob) {
  TempDir dir;
  int64_t now = 1000;
  auto s = OpenOrDie(Options(dir.path(), &now));
  auto id = s->Submit("acme", Spec({"c", "a", "b"}));
  ASSERT_TRUE(id.ok()) << id.status();
  auto info = s->Get("acme", *id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->status, JobStatus::kInProgress);
  EXPECT_EQ(info->created_at, 1000);
  EXPECT_EQ(info->expires_at, 1000 + 5000);
  EXPECT_EQ(info->counts, (JobCounts{3, 3, 0, 0, 0, 0}));

  auto leases = s->Claim(2);
  ASSERT_TRUE(leases.ok());
  ASSERT_EQ(leases->size(), 2u);
  EXPECT_EQ((*leases)[0].custom_id, "c");
  EXPECT_EQ((*leases)[0].attempt, 1u);
  EXPECT_EQ((*leases)[0].document_ids, (std::vector<std::string>{"doc-1", "doc-2"}));
  EXPECT_EQ((*leases)[0].options, Item("x").options);
  EXPECT_EQ((*leases)[1].custom_id, "a");
  ASSERT_TRUE(s->Complete(*id, 0, 1, Answer("yes")).ok());
  ASSERT_TRUE(s->Complete(*id, 1, 1, Answer("boom", false)).ok());
  // A second result for item 0 changes nothing; an attempt never leased is refused.
  ASSERT_TRUE(s->Complete(*id, 0, 1, Answer("other")).ok());
  EXPECT_EQ(s->stats().duplicate_results_ignored, 1);
  EXPECT_EQ(s->Complete(*id, 2, 1, Answer("early")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->Complete(*id, 7, 1, Answer("x")).code(), StatusCode::kNotFound);

  // Item 2: leased, its worker lost (released), leased again; a stale release is ignored.
  leases = s->Claim(5);
  ASSERT_TRUE(leases.ok());
  ASSERT_EQ(leases->size(), 1u);
  EXPECT_EQ((*leases)[0].attempt, 1u);
  ASSERT_TRUE(s->Release(*id, 2, 1).ok());
  EXPECT_EQ(s->Get("acme", *id)->counts.pending, 1);
  leases = s->Claim(5);
  ASSERT_EQ(leases->size(), 1u);
  EXPECT_EQ((*leases)[0].attempt, 2u);
  ASSERT_TRUE(s->Release(*id, 2, 1).ok());
  EXPECT_EQ(s->stats().stale_releases_ignored, 1);
  EXPECT_EQ(s->Get("acme", *id)->counts.running, 1);
  EXPECT_EQ(s->Delete("acme", *id).code(), StatusCode::kFailedPrecondition);
  now = 1100;
  // The lost worker (attempt 1) reports first: its result wins; attempt 2's is a duplicate.
  ASSERT_TRUE(s->Complete(*id, 2, 1, Answer("from attempt 1")).ok());
  ASSERT_TRUE(s->Complete(*id, 2, 2, Answer("from attempt 2")).ok());
  info = s->Get("acme", *id);
  EXPECT_EQ(info->status, JobStatus::kCompleted);  // completed although one item failed
  EXPECT_EQ(info->finished_at, 1100);
  EXPECT_EQ(info->counts, (JobCounts{3, 0, 0, 2, 1, 0}));
  auto results = ResultsAll(*s, "acme", *id, 2);
  ASSERT_TRUE(results.ok());
  ASSERT_EQ(results->size(), 3u);
  EXPECT_EQ(Describe((*results)[0]), Describe(ItemOutcome{"a", 1, ItemState::kFailed, Answer("boom", false)}));
  EXPECT_EQ(Describe((*results)[1]), Describe(ItemOutcome{"b", 2, ItemState::kSucceeded, Answer("from attempt 1")}));
  EXPECT_EQ(Describe((*results)[2]), Describe(ItemOutcome{"c", 0, ItemState::kSucceeded, Answer("yes")}));
  EXPECT_EQ(s->Cancel("acme", *id).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s->Delete("acme", *id).ok());
  EXPECT_EQ(s->Get("acme", *id).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s->Complete(*id, 0, 1, Answer("late")).code(), StatusCode::kNotFound);
}

TEST(JobStoreTest, CancelWaitsForRunningItemsAndExpiryFailsTheUnfinished) {
  TempDir dir;
  int64_t now = 1000;
  auto s = OpenOrDie(Options(dir.path(), &now));
  auto id = s->Submit("acme", Spec({"a", "b", "c"}));
  ASSERT_TRUE(id.ok());
  ASSERT_EQ(s->Claim(2)->size(), 2u);
  ASSERT_TRUE(s->Release(*id, 1, 1).ok());  // b: pending again, after a lease
  now = 1010;
  ASSERT_TRUE(s->Cancel("acme", *id).ok());
  auto info = s->Get("acme", *id);
  EXPECT_EQ(info->status, JobStatus::kCancelling);
  EXPECT_EQ(info->counts, (JobCounts{3, 0, 1, 0, 0, 2}));
  ASSERT_TRUE(s->Cancel("acme", *id).ok());  // already cancelling
  EXPECT_EQ(s->Claim(10)->size(), 0u);
  ASSERT_TRUE(s->Complete(*id, 1, 1, Answer("x")).ok());  // b, cancelled: its old lease's result is ignored
  EXPECT_EQ(s->stats().duplicate_results_ignored, 1);
  now = 1020;
  ASSERT_TRUE(s->Complete(*id, 0, 1, Answer("finished anyway")).ok());  // the running item's result is kept
  info = s->Get("acme", *id);
  EXPECT_EQ(info->status, JobStatus::kCancelled);
  EXPECT_EQ(info->finished_at, 1020);
  EXPECT_EQ(info->counts, (JobCounts{3, 0, 0, 1, 0, 2}));
  auto results = ResultsAll(*s, "acme", *id, 10);
  ASSERT_EQ(results->size(), 3u);
  EXPECT_EQ((*results)[1].state, ItemState::kCancelled);
  EXPECT_EQ((*results)[1].result.error, "cancelled");

  // Expiry: at created_at + window, not before; finished results stay.
  auto e = s->Submit("acme", Spec({"x", "y", "z"}, /*window_s=*/100));
  ASSERT_TRUE(e.ok());
  auto l = s->Claim(2);
  ASSERT_EQ(l->size(), 2u);
  ASSERT_TRUE(s->Complete(*e, 0, 1, Answer("done")).ok());
  ASSERT_TRUE(s->ExpireDue(now + 99).ok());
  EXPECT_EQ(s->Get("acme", *e)->status, JobStatus::kInProgress);
  ASSERT_TRUE(s->ExpireDue(now + 100).ok());
  info = s->Get("acme", *e);
  EXPECT_EQ(info->status, JobStatus::kExpired);
  EXPECT_EQ(info->finished_at, now + 100);
  EXPECT_EQ(info->counts, (JobCounts{3, 0, 0, 1, 2, 0}));
  results = ResultsAll(*s, "acme", *e, 10);
  ASSERT_EQ(results->size(), 3u);
  EXPECT_EQ((*results)[0].result.answer, "done");
  EXPECT_EQ((*results)[1].result.error, "expired");
  EXPECT_EQ((*results)[2].result.error, "expired");
  ASSERT_TRUE(s->Complete(*e, 1, 1, Answer("too late")).ok());  // ignored
  EXPECT_EQ(ResultsAll(*s, "acme", *e, 10)->at(1).result.error, "expired");
  EXPECT_EQ(s->stats().jobs_expired, 1);
}

TEST(JobStoreTest, BadSubmissionsNameTheItemAndStoreNothing) {
  TempDir dir;
  int64_t now = 1000;
  JobStoreOptions o = Options(dir.path(), &now);
  o.max_items_per_job = 4;
  o.max_question_bytes = 10;
  auto s = OpenOrDie(o);
  auto expect_error = [&](const std::string& tenant, const JobSpec& spec, const std::vector<std::string>& words) {
    auto r = s->Submit(tenant, spec);
    ASSERT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
    for (const auto& w : words) EXPECT_NE(r.status().message().find(w), std::string::npos) << r.status() << " / " << w;
  };
  expect_error("acme", Spec({}), {"no items"});
  expect_error("acme", Spec({"a", "b", "c", "d", "e"}), {"5 items", "at most 4", "max_items_per_job"});
  expect_error("acme", Spec({"a", ""}), {"item 1", "custom_id is empty"});
  expect_error("acme", Spec({"a", std::string(257, 'k')}), {"item 1", "custom_id 'kkk", "257 bytes", "at most 256"});
  JobSpec long_question = Spec({"a", "b", "c"});
  long_question.items[2].question = std::string(11, 'q');
  expect_error("acme", long_question, {"item 2", "custom_id 'c'", "question is 11 bytes", "max_question_bytes"});
  expect_error("acme", Spec({"a", "b", "a"}), {"item 2", "custom_id 'a'", "item 0"});
  expect_error("acme", Spec({"a"}, -5), {"completion_window_s", "-5"});
  expect_error("", Spec({"a"}), {"tenant is empty"});
  expect_error(std::string(300, 't'), Spec({"a"}), {"tenant", "300 bytes"});
  EXPECT_TRUE(ListAll(*s, "acme", 10).empty());
  EXPECT_EQ(s->stats().submits, 0);
  // The limits themselves are allowed.
  JobSpec edge = Spec({"a", "b", "c", std::string(256, 'k')});
  edge.items[0].question = std::string(10, 'q');
  ASSERT_TRUE(s->Submit("acme", edge).ok());
  // Bad options.
  EXPECT_EQ(JobStore::Open(JobStoreOptions{}).status().code(), StatusCode::kInvalidArgument);
  JobStoreOptions bad = o;
  bad.path = dir.path() + "/other";
  bad.default_completion_window_s = 0;
  auto refused = JobStore::Open(bad);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("default_completion_window_s"), std::string::npos) << refused.status();
}

TEST(JobStoreTest, AnotherTenantNeverSeesAJob) {
  TempDir dir;
  int64_t now = 1000;
  auto s = OpenOrDie(Options(dir.path(), &now));
  auto id = s->Submit("acme", Spec({"a", "b"}));
  ASSERT_TRUE(id.ok());
  ASSERT_EQ(s->Claim(1)->size(), 1u);
  ASSERT_TRUE(s->Complete(*id, 0, 1, Answer("secret")).ok());
  const std::string made_up = "job-0123456789abcdef";
  for (const std::string& job : {*id, made_up}) {
    auto get = s->Get("beta", job);
    EXPECT_EQ(get.status().code(), StatusCode::kNotFound);
    EXPECT_EQ(get.status().message(), "job store: job " + job + " not found");  // the same words either way
    EXPECT_EQ(s->Results("beta", job, "", 10).status().code(), StatusCode::kNotFound);
    EXPECT_EQ(s->Cancel("beta", job).code(), StatusCode::kNotFound);
    EXPECT_EQ(s->Delete("beta", job).code(), StatusCode::kNotFound);
  }
  EXPECT_TRUE(ListAll(*s, "beta", 10).empty());
  EXPECT_EQ(ListAll(*s, "acme", 10).size(), 1u);
  // Nothing of it changed: still in progress, result still there.
  auto info = s->Get("acme", *id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->status, JobStatus::kInProgress);
  EXPECT_EQ(ResultsAll(*s, "acme", *id, 10)->at(0).result.answer, "secret");
}

TEST(JobStoreTest, PagingVisitsEveryJobAndResultOnceInOrder) {
  TempDir dir;
  int64_t now = 1000;
  auto s = OpenOrDie(Options(dir.path(), &now));
  std::vector<std::string> ids;
  for (int i = 0; i < 23; ++i) {
    ++now;
    auto id = s->Submit(i % 3 == 0 ? "beta" : "acme", Spec({"x"}));
    ASSERT_TRUE(id.ok());
    if (i % 3 != 0) ids.push_back(*id);
  }
  for (size_t page_size : {1, 2, 5, 15, 16, 1000}) {
    std::vector<std::string> got;
    for (const auto& j : ListAll(*s, "acme", page_size)) got.push_back(j.id);
    EXPECT_EQ(got, ids) << "page size " << page_size;
  }
  // The token is the last job of a page: deleting that job does not break paging.
  auto first = s->List("acme", "", 4);
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->next_page_token, ids[3]);
  ASSERT_TRUE(s->Cancel("acme", ids[3]).ok());
  ASSERT_TRUE(s->Delete("acme", ids[3]).ok());
  auto second = s->List("acme", first->next_page_token, 4);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->jobs.size(), 4u);
  EXPECT_EQ(second->jobs[0].id, ids[4]);
  EXPECT_EQ(s->List("acme", "not-a-token", 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->List("acme", "", 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->List("acme", "", kMaxPageSize + 1).status().code(), StatusCode::kInvalidArgument);

  // Results in custom_id byte order, unfinished items skipped, across pages.
  std::vector<std::string> custom_ids;
  for (int i = 0; i < 40; ++i) {
    custom_ids.push_back(std::string(1, static_cast<char>('A' + (i * 7) % 40)) + "-" + std::to_string(i));
  }
  auto id = s->Submit("acme", Spec(custom_ids));
  ASSERT_TRUE(id.ok());
  auto leases = s->Claim(1000);
  ASSERT_TRUE(leases.ok());
  std::vector<std::string> finished;
  for (const auto& l : *leases) {
    if (l.job_id != *id || l.item_index % 3 == 0) continue;
    ASSERT_TRUE(s->Complete(*id, l.item_index, l.attempt, Answer(l.custom_id)).ok());
    finished.push_back(l.custom_id);
  }
  std::sort(finished.begin(), finished.end());
  for (size_t page_size : {1, 3, 26, 27, 100}) {
    auto all = ResultsAll(*s, "acme", *id, page_size);
    ASSERT_TRUE(all.ok()) << all.status();
    std::vector<std::string> got;
    for (const auto& o : *all) {
      got.push_back(o.custom_id);
      EXPECT_EQ(o.result.answer, o.custom_id);
      EXPECT_EQ(o.custom_id, custom_ids[o.item_index]);
    }
    EXPECT_EQ(got, finished) << "page size " << page_size;
  }
  EXPECT_EQ(s->Results("acme", *id, "", 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(JobStoreTest, JobIdsNeverRepeatAcrossDeletesAndReopens) {
  TempDir dir;
  int64_t now = 1000;
  const JobStoreOptions o = Options(dir.path(), &now);
  std::set<std::string> ids;
  for (int round = 0; round < 5; ++round) {
    auto s = OpenOrDie(o);
    for (int i = 0; i < 20; ++i) {
      auto id = s->Submit("acme", Spec({"a"}));
      ASSERT_TRUE(id.ok());
      ASSERT_EQ(id->size(), 20u);
      ASSERT_EQ(id->substr(0, 4), "job-");
      ASSERT_EQ(id->find_first_not_of("0123456789abcdef", 4), std::string::npos) << *id;
      ASSERT_TRUE(ids.insert(*id).second) << *id << " repeated";
      ASSERT_TRUE(s->Cancel("acme", *id).ok());
      ASSERT_TRUE(s->Delete("acme", *id).ok());  // the newest job gone: its id still is not reused
    }
  }
  EXPECT_EQ(ids.size(), 100u);
}

TEST(JobStoreTest, ReopenResumesUnfinishedJobs) {
  TempDir dir;
  int64_t now = 1000;
  const JobStoreOptions o = Options(dir.path(), &now);
  std::string a, b;
  {
    auto s = OpenOrDie(o);
    a = *s->Submit("acme", Spec({"a0", "a1", "a2"}));
    b = *s->Submit("acme", Spec({"b0", "b1"}));
    auto l = s->Claim(4);  // a0 a1 a2 b0 running
    ASSERT_EQ(l->size(), 4u);
    ASSERT_TRUE(s->Complete(a, 0, 1, Answer("kept")).ok());
    ASSERT_TRUE(s->Cancel("acme", b).ok());  // b1 cancelled, b0 running: cancelling
    EXPECT_EQ(s->Get("acme", b)->status, JobStatus::kCancelling);
  }  // a "crash": the store goes with items running
  now = 2000;
  auto s = OpenOrDie(o);
  EXPECT_EQ(s->stats().recoveries, 3);
  auto ia = s->Get("acme", a);
  ASSERT_TRUE(ia.ok());
  EXPECT_EQ(ia->status, JobStatus::kInProgress);
  EXPECT_EQ(ia->counts, (JobCounts{3, 2, 0, 1, 0, 0}));
  auto ib = s->Get("acme", b);
  EXPECT_EQ(ib->status, JobStatus::kCancelled);
  EXPECT_EQ(ib->finished_at, 2000);
  EXPECT_EQ(ib->counts, (JobCounts{2, 0, 0, 0, 0, 2}));
  // The attempt numbers were kept: the next lease of a1 is attempt 2.
  auto l = s->Claim(10);
  ASSERT_EQ(l->size(), 2u);
  EXPECT_EQ((*l)[0].custom_id, "a1");
  EXPECT_EQ((*l)[0].attempt, 2u);
  // The result recorded before the restart is there, once.
  ASSERT_TRUE(s->Complete(a, 0, 1, Answer("again")).ok());
  EXPECT_EQ(ResultsAll(*s, "acme", a, 10)->at(0).result.answer, "kept");
}

TEST(JobStoreTest, DamagedRecordsAreCorruptionNeverACrash) {
  TempDir dir;
  int64_t now = 1000;
  const JobStoreOptions o = Options(dir.path(), &now);
  std::string healthy, bad_job, bad_state, bad_spec, bad_index;
  {
    auto s = OpenOrDie(o);
    healthy = *s->Submit("acme", Spec({"h0", "h1"}));
    bad_job = *s->Submit("acme", Spec({"j0"}));
    bad_state = *s->Submit("acme", Spec({"s0"}));
    ASSERT_TRUE(s->CorruptRecordForTest(bad_job, JobStore::RecordKind::kJob).ok());
    ASSERT_TRUE(s->CorruptRecordForTest(bad_state, JobStore::RecordKind::kItemState).ok());
    EXPECT_EQ(s->CorruptRecordForTest("job-0000000000000000", JobStore::RecordKind::kJob).code(),
              StatusCode::kNotFound);
  }
  auto s = OpenOrDie(o);
  EXPECT_EQ(s->stats().corrupt_records, 2);
  auto g = s->Get("acme", bad_job);
  EXPECT_EQ(g.status().code(), StatusCode::kCorruption);
  EXPECT_NE(g.status().message().find("job record of job " + bad_job), std::string::npos) << g.status();
  g = s->Get("acme", bad_state);
  EXPECT_EQ(g.status().code(), StatusCode::kCorruption);
  EXPECT_NE(g.status().message().find("item state record of job " + bad_state + ", item 0"), std::string::npos)
      << g.status();
  EXPECT_EQ(s->Results("acme", bad_state, "", 10).status().code(), StatusCode::kCorruption);
  EXPECT_EQ(s->Cancel("acme", bad_state).code(), StatusCode::kCorruption);
  // List shows the damaged job of a known owner, marked; the one whose owner is unknown is not listed.
  auto listed = ListAll(*s, "acme", 10);
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].id, healthy);
  EXPECT_TRUE(listed[0].damage.empty());
  EXPECT_EQ(listed[1].id, bad_state);
  EXPECT_NE(listed[1].damage.find("item state"), std::string::npos);
  // Work goes on around them: only the healthy job's items are leased.
  bad_spec = *s->Submit("acme", Spec({"p0"}));
  bad_index = *s->Submit("acme", Spec({"i0", "i1"}));
  ASSERT_TRUE(s->CorruptRecordForTest(bad_spec, JobStore::RecordKind::kItemSpec).ok());
  ASSERT_TRUE(s->CorruptRecordForTest(bad_index, JobStore::RecordKind::kCustomIdIndex).ok());
  auto l = s->Claim(10);
  ASSERT_TRUE(l.ok()) << l.status();
  std::set<std::string> leased_jobs;
  for (const auto& x : *l) leased_jobs.insert(x.job_id);
  EXPECT_EQ(leased_jobs, (std::set<std::string>{healthy, bad_index}));
  EXPECT_EQ(s->stats().corrupt_records, 3);
  g = s->Get("acme", bad_spec);
  EXPECT_EQ(g.status().code(), StatusCode::kCorruption);
  EXPECT_NE(g.status().message().find("item spec record of job " + bad_spec), std::string::npos) << g.status();
  EXPECT_EQ(s->Complete(bad_spec, 0, 1, Answer("x")).code(), StatusCode::kCorruption);
  // Index damage shows when results are read.
  for (const auto& x : *l) {
    if (x.job_id == bad_index) {
      ASSERT_TRUE(s->Complete(bad_index, x.item_index, x.attempt, Answer("x")).ok());
    }
  }
  auto r = s->Results("acme", bad_index, "", 10);
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  EXPECT_NE(r.status().message().find("custom-id index record of job " + bad_index), std::string::npos) << r.status();
  EXPECT_EQ(s->stats().corrupt_records, 4);
  // The owner may delete a damaged job; after that, a reopen finds nothing damaged but the ownerless one.
  ASSERT_TRUE(s->Delete("acme", bad_state).ok());
  ASSERT_TRUE(s->Delete("acme", bad_spec).ok());
  ASSERT_TRUE(s->Delete("acme", bad_index).ok());
  EXPECT_EQ(s->Delete("acme", bad_job).code(), StatusCode::kCorruption);
  s.reset();
  s = OpenOrDie(o);
  EXPECT_EQ(s->stats().corrupt_records, 1);
  EXPECT_EQ(ListAll(*s, "acme", 10).size(), 1u);
  auto h = s->Get("acme", healthy);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->counts.pending, 2);  // its leases were recovered
}

TEST(JobStoreTest, ConcurrentWorkersRecordEachItemOnce) {
  TempDir dir;
  int64_t now = 1000;
  auto s = OpenOrDie(Options(dir.path(), &now));
  std::vector<std::string> ids;
  int64_t items = 0;
  for (int j = 0; j < 12; ++j) {
    std::vector<std::string> custom_ids;
    for (int i = 0; i <= j % 5; ++i) custom_ids.push_back("item-" + std::to_string(i));
    items += static_cast<int64_t>(custom_ids.size());
    ids.push_back(*s->Submit(kTenants[j % 3], Spec(custom_ids)));
  }
  // Four workers lease, answer (twice, the second a duplicate) or give back items until none is left.
  std::vector<std::thread> workers;
  for (int w = 0; w < 4; ++w) {
    workers.emplace_back([&s, w] {
      std::mt19937_64 rng(w);
      for (int idle = 0; idle < 50;) {
        auto leases = s->Claim(1 + rng() % 3);
        CHECK(leases.ok()) << leases.status();
        if (leases->empty()) {
          ++idle;
          std::this_thread::yield();
          continue;
        }
        for (const auto& l : *leases) {
          if (rng() % 5 == 0) {
            CHECK(s->Release(l.job_id, l.item_index, l.attempt).ok());
            continue;
          }
          CHECK(s->Complete(l.job_id, l.item_index, l.attempt, Answer(l.custom_id + "/" + std::to_string(w))).ok());
          CHECK(s->Complete(l.job_id, l.item_index, l.attempt, Answer("duplicate")).ok());
        }
      }
    });
  }
  for (auto& t : workers) t.join();
  for (size_t j = 0; j < ids.size(); ++j) {
    auto info = s->Get(kTenants[j % 3], ids[j]);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->status, JobStatus::kCompleted);
    auto results = ResultsAll(*s, kTenants[j % 3], ids[j], 2);
    ASSERT_TRUE(results.ok());
    ASSERT_EQ(static_cast<int64_t>(results->size()), info->counts.total);
    for (const auto& o : *results) EXPECT_EQ(o.result.answer.substr(0, o.custom_id.size() + 1), o.custom_id + "/");
  }
  const JobStoreStats st = s->stats();
  EXPECT_EQ(st.results_recorded, items);
  EXPECT_EQ(st.duplicate_results_ignored, items);
  EXPECT_EQ(st.items_claimed, items + st.releases);
}

TEST(JobStoreTest, OptionsLoadFromYamlAndBadKeysAreNamed) {
  auto r = ConfigReader::FromString(
      "path: /tmp/jobs\nsync_writes: false\nmax_items_per_job: 10\n"
      "max_question_bytes: 2048\ndefault_completion_window_s: 3600\n");
  ASSERT_TRUE(r.ok()) << r.status();
  JobStoreOptions o;
  ASSERT_TRUE(LoadJobStoreOptions(*r, &o).ok());
  EXPECT_EQ(o.path, "/tmp/jobs");
  EXPECT_FALSE(o.sync_writes);
  EXPECT_EQ(o.max_items_per_job, 10u);
  EXPECT_EQ(o.max_question_bytes, 2048u);
  EXPECT_EQ(o.default_completion_window_s, 3600);
  auto bad = ConfigReader::FromString("max_items_per_job: 0\n");
  ASSERT_TRUE(bad.ok());
  Status st = LoadJobStoreOptions(*bad, &o);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("max_items_per_job"), std::string::npos) << st;
  auto unknown = ConfigReader::FromString("max_item_per_job: 3\n");
  ASSERT_TRUE(unknown.ok());
  st = LoadJobStoreOptions(*unknown, &o);
  EXPECT_NE(st.message().find("max_item_per_job"), std::string::npos) << st;
}

}  // namespace
}  // namespace penumbra::jobs
