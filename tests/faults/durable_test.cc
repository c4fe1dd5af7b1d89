// Fault tests (issue 38, "durable"): real penumbra-worker and
// penumbra-coordinator processes (tests/service/service_cluster.h).
//
// CoordinatorOnAFullDiskAcknowledgesOnlyWhatItStores: the coordinator's data
// directory on a small tmpfs (tests/small_disk.h; skipped where it cannot be
// mounted), filled to ENOSPC during puts, deletes and job submissions. Every
// call either succeeds or fails with RESOURCE_EXHAUSTED saying the disk is
// full; /metrics shows the registry degraded and its write errors; after the
// filler is removed the coordinator writes again without a restart; after a
// SIGKILL and a restart on the same data directory, the documents and jobs
// are exactly those acknowledged (a model: std::map).
//
// ADeleteReachesAWorkerThatWasDown: a document deleted while its worker is
// down keeps a tombstone (across a coordinator restart) until the worker is
// back and confirms the forget.
//
// AWorkersFullPrefixStoreIsCountedAndRecovers: a worker's --prefix-store on a
// small tmpfs filled to ENOSPC: puts still succeed (the worker holds the
// state in memory), the refused segment writes show on its /metrics
// (degraded, write errors); once freed, the store writes again without a
// restart.
#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>

#include "tests/service/service_cluster.h"
#include "tests/small_disk.h"
#include "tests/worker/stories_shadowkv.h"

namespace penumbra::testing {
namespace {

// The value of metric `name` with labels `labels` ("" none) on the
// /metrics of `port` (the coordinator's by default); -1 when absent.
double Metric(Cluster& cluster, const std::string& name, const std::string& labels, int port = 0) {
  httplib::Client m("127.0.0.1", port ? port : cluster.coordinator().metrics_port);
  auto r = m.Get("/metrics");
  if (!r || r->status != 200) return -1;
  const std::string key = name + (labels.empty() ? "" : "{" + labels + "}") + " ";
  const size_t at = r->body.find("\n" + key);
  if (at == std::string::npos) return -1;
  return std::stod(r->body.substr(at + 1 + key.size()));
}

rpc::GenerateRequest Ask(const std::string& doc, int seed, int max_new = 2) {
  rpc::GenerateRequest r;
  r.document_ids = {doc};
  r.__set_token_ids(LcgTokens(6, 900 + seed, false));
  r.max_new_tokens = max_new;
  r.ignore_eos = true;
  return r;
}

rpc::SubmitJobRequest Job(const std::string& doc, int items, int seed, int max_new = 2) {
  rpc::SubmitJobRequest j;
  for (int i = 0; i < items; ++i) {
    rpc::JobItem it;
    it.custom_id = "item-" + std::to_string(i) + "-" + std::string(200, 'x');
    it.request = Ask(doc, seed * 100 + i, max_new);
    j.items.push_back(it);
  }
  return j;
}

::testing::AssertionResult DiskFull(const Status& s) {
  if (s.code() == StatusCode::kResourceExhausted && s.message().find("disk is full") != std::string::npos) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "expected RESOURCE_EXHAUSTED saying the disk is full, got " << s;
}

TEST(Durable, CoordinatorOnAFullDiskAcknowledgesOnlyWhatItStores) {
  SmallDisk disk(24);
  if (!disk.ok()) GTEST_SKIP() << disk.why();
  const std::string data = disk.dir() + "/data";
  Cluster cluster({});
  ASSERT_TRUE(cluster.StartWorker(0));
  ASSERT_TRUE(cluster.StartCoordinator({"--data-dir", data, "--job-concurrency", "2"}));
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  std::map<std::string, std::vector<int32_t>> ready;  // the model: acknowledged READY documents
  std::set<std::string> jobs;                         // acknowledged jobs
  int seed = 0;
  auto put = [&]() -> Status {
    const std::vector<int32_t> ids = LcgTokens(400, 38000 + ++seed, true);
    auto d = c->PutDocument("doc", nullptr, &ids);
    if (!d.ok()) return d.status();
    EXPECT_EQ(d->state, rpc::DocumentState::READY) << "acknowledged, not READY: " << d->error;
    ready[d->id] = ids;
    return Status::OK();
  };
  std::string job_doc;  // the document jobs ask about: never deleted
  auto remove = [&]() -> Status {
    auto victim = ready.begin();
    if (victim->first == job_doc) ++victim;
    const std::string id = victim->first;
    Status s = c->DeleteDocument(id);
    if (s.ok()) ready.erase(id);
    return s;
  };
  auto submit = [&]() -> Status {
    auto j = c->SubmitJob(Job(job_doc, 6, ++seed));
    if (!j.ok()) return j.status();
    jobs.insert(j->id);
    return Status::OK();
  };
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(put().ok());
  job_doc = ready.begin()->first;
  ASSERT_TRUE(submit().ok());
  // A longer job whose items run while the disk fills: their results are
  // refused, kept by the coordinator and written once there is room.
  auto running = c->SubmitJob(Job(job_doc, 16, 77, 24));
  ASSERT_TRUE(running.ok()) << running.status();
  jobs.insert(running->id);

  // Full: every call succeeds (and is kept) or fails typed.
  disk.Fill();
  int failures = 0;
  for (int i = 0; i < 6; ++i) {
    for (const Status& s : {put(), remove(), submit()}) {
      if (s.ok()) continue;
      ++failures;
      EXPECT_TRUE(DiskFull(s));
    }
    // A failed delete leaves the document READY.
    for (const auto& [id, ids] : ready) {
      auto d = c->GetDocument(id);
      ASSERT_TRUE(d.ok()) << "acknowledged document " << id << " is gone: " << d.status();
      EXPECT_EQ(d->state, rpc::DocumentState::READY);
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // job items finish meanwhile
  std::printf(
      "full disk: %d calls refused; %zu documents and %zu jobs acknowledged so far; job store: %g writes "
      "refused\n",
      failures, ready.size(), jobs.size(),
      Metric(cluster, "penumbra_coordinator_store_write_errors_total", "store=\"job_store\""));
  EXPECT_GT(failures, 0);
  EXPECT_EQ(Metric(cluster, "penumbra_coordinator_store_degraded", "store=\"document_registry\""), 1);
  EXPECT_GT(Metric(cluster, "penumbra_coordinator_store_write_errors_total", "store=\"document_registry\""), 0);

  // Space returns: writes again, no restart.
  disk.Free();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  Status s;
  while (!(s = put()).ok()) {
    ASSERT_TRUE(DiskFull(s));
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "still refused after the disk was freed: " << s;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ASSERT_TRUE(remove().ok());
  ASSERT_TRUE(put().ok());
  while (!(s = submit()).ok()) {
    ASSERT_TRUE(DiskFull(s));
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "jobs still refused after the disk was freed: " << s;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_EQ(Metric(cluster, "penumbra_coordinator_store_degraded", "store=\"document_registry\""), 0);

  // SIGKILL, restart on the same data directory: exactly what was acknowledged.
  cluster.coordinator().process.reset();
  ASSERT_TRUE(cluster.StartCoordinator({"--data-dir", data, "--job-concurrency", "2"}));
  c = cluster.Client();
  ASSERT_TRUE(c);
  auto docs = c->ListDocuments();
  ASSERT_TRUE(docs.ok()) << docs.status();
  std::map<std::string, int64_t> seen;
  for (const rpc::DocumentInfo& d : *docs) {
    EXPECT_EQ(d.state, rpc::DocumentState::READY) << d.id;
    seen[d.id] = d.tokens;
  }
  std::map<std::string, int64_t> want;
  for (const auto& [id, ids] : ready) want[id] = static_cast<int64_t>(ids.size());
  EXPECT_TRUE(seen == want) << seen.size() << " documents after the restart, " << want.size() << " acknowledged";
  auto listed = c->ListJobs();
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::set<std::string> seen_jobs;
  for (const rpc::JobInfo& j : *listed) seen_jobs.insert(j.id);
  EXPECT_TRUE(seen_jobs == jobs) << seen_jobs.size() << " jobs after the restart, " << jobs.size() << " acknowledged";
  // Every item of every acknowledged job is answered, once (results refused
  // while the disk was full were kept and written again).
  for (const std::string& id : jobs) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(40);
    rpc::JobInfo j;
    do {
      auto g = c->GetJob(id);
      ASSERT_TRUE(g.ok()) << g.status();
      j = *g;
      if (j.status == rpc::JobStatus::COMPLETED) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    } while (std::chrono::steady_clock::now() < until);
    ASSERT_EQ(j.status, rpc::JobStatus::COMPLETED) << "job " << id << " not finished";
    EXPECT_EQ(j.completed, j.total) << "job " << id;
    auto results = c->JobResults(id);
    ASSERT_TRUE(results.ok()) << results.status();
    std::set<std::string> answered;
    for (const rpc::JobItemResult& r : *results) {
      EXPECT_TRUE(r.ok) << r.custom_id << ": " << r.error;
      EXPECT_TRUE(answered.insert(r.custom_id).second) << r.custom_id << " answered twice";
    }
    EXPECT_EQ(static_cast<int64_t>(answered.size()), j.total);
  }
}

TEST(Durable, ADeleteReachesAWorkerThatWasDown) {
  Cluster cluster({});
  const std::string data = cluster.dir() + "/data";
  ASSERT_TRUE(cluster.StartWorker(0));
  ASSERT_TRUE(cluster.StartCoordinator({"--data-dir", data}));
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  const std::vector<int32_t> ids = LcgTokens(200, 3801, true);
  auto d = c->PutDocument("doc", nullptr, &ids);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->state, rpc::DocumentState::READY);
  const int port = cluster.worker(0).port;
  cluster.worker(0).process.reset();  // SIGKILL
  ASSERT_TRUE(c->DeleteDocument(d->id).ok());
  EXPECT_EQ(c->GetDocument(d->id).status().code(), StatusCode::kNotFound);
  // Kept while the worker is down (sweeps every 2 s), and across a restart.
  std::this_thread::sleep_for(std::chrono::seconds(3));
  EXPECT_EQ(Metric(cluster, "penumbra_coordinator_document_tombstones", ""), 1);
  cluster.coordinator().process.reset();
  ASSERT_TRUE(cluster.StartCoordinator({"--data-dir", data}));
  EXPECT_EQ(Metric(cluster, "penumbra_coordinator_document_tombstones", ""), 1);
  ASSERT_TRUE(cluster.StartWorker(0, port));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  double left = 1;
  while ((left = Metric(cluster, "penumbra_coordinator_document_tombstones", "")) != 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_EQ(left, 0) << "the tombstone was not dropped after the worker came back";
  // Its id is not handed out again; the coordinator keeps serving.
  c = cluster.Client();
  ASSERT_TRUE(c);
  auto e = c->PutDocument("doc", nullptr, &ids);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_NE(e->id, d->id);
}

TEST(Durable, AWorkersFullPrefixStoreIsCountedAndRecovers) {
  SmallDisk disk(16);
  if (!disk.ok()) GTEST_SKIP() << disk.why();
  ClusterOptions o;
  o.worker_flags = {"--prefix-store", disk.dir() + "/prefix"};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  const int wm = cluster.worker(0).metrics_port;
  auto metric = [&](const char* name) { return Metric(cluster, name, "", wm); };
  int seed = 0;
  auto put = [&] {
    const std::vector<int32_t> ids = LcgTokens(400, 38500 + ++seed, true);
    auto d = c->PutDocument("doc", nullptr, &ids);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->state, rpc::DocumentState::READY);
  };
  put();
  EXPECT_EQ(metric("penumbra_worker_store_degraded"), 0);
  disk.Fill();
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (metric("penumbra_worker_store_degraded") != 1) {
    ASSERT_LT(std::chrono::steady_clock::now(), until) << "no refused write shows on the worker's /metrics";
    put();  // still served: the store is only where the state is kept across restarts
  }
  EXPECT_GT(metric("penumbra_worker_store_write_errors_total"), 0);
  disk.Free();
  until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (metric("penumbra_worker_store_degraded") != 0) {
    ASSERT_LT(std::chrono::steady_clock::now(), until) << "the prefix store did not recover once the disk was freed";
    put();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace
}  // namespace penumbra::testing
