// Requests owned under a lease (issue 38, part "leases"), with real
// processes on loopback (CPU backend, models/penumbra-eval): a coordinator
// SIGKILLed mid-stream and restarted on its data directory continues the
// client's stream with exactly the tokens an uninterrupted run gives; a
// worker drops the generations of a coordinator that stopped renewing its
// lease; a batch job's item in flight at a restart runs once and its cancel
// stops it; an expired drain and a Complete whose client hangs up leave
// nothing on the workers. Each TEST is its own CTest (label `faults`).
#include <atomic>
#include <chrono>
#include <functional>
#include <optional>
#include <thread>

#include "tests/service/service_cluster.h"

namespace penumbra::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string EvalModel() { return SourceDir() + "/models/penumbra-eval"; }

class Leases : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(DataExists(EvalModel() + "/config.json")); }
};

// A question: BOS (0) then ids from a fixed LCG inside the model's vocabulary.
std::vector<int32_t> Question(int n, uint64_t seed) {
  std::vector<int32_t> t = {0};
  uint64_t x = seed;
  while (static_cast<int>(t.size()) < n) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    t.push_back(static_cast<int32_t>(3 + (x >> 33) % 8000));
  }
  return t;
}

// Seeded sampling, policy full, no end of text: max_new tokens exactly.
rpc::GenerateRequest Sampled(const std::vector<int32_t>& question, int max_new, int64_t seed) {
  rpc::GenerateRequest r;
  r.__set_token_ids(question);
  r.max_new_tokens = max_new;
  r.ignore_eos = true;
  r.kv_policy = "full";
  r.sampling.temperature = 0.9;
  r.sampling.top_k = 50;
  r.sampling.top_p = 0.95;
  r.sampling.seed = seed;
  return r;
}

ClusterOptions Options(int lease_ms) {
  ClusterOptions o;
  o.model = EvalModel();
  o.worker_flags = {"--lease-ms", std::to_string(lease_ms)};
  return o;
}

int64_t Running(const rpc::WorkerStats& s) { return s.queued + s.prefilling + s.decoding; }

// Waits until worker i runs no generation; how long it took, or nullopt
// after `timeout`.
std::optional<std::chrono::milliseconds> WaitIdle(Cluster& c, int i, std::chrono::milliseconds timeout) {
  const Clock::time_point t0 = Clock::now();
  while (Clock::now() - t0 < timeout) {
    if (Running(c.WorkerStats(i)) == 0) return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
    std::this_thread::sleep_for(50ms);
  }
  return std::nullopt;
}

// Waits until worker i runs at least one generation.
bool WaitBusy(Cluster& c, int i, std::chrono::milliseconds timeout) {
  const Clock::time_point t0 = Clock::now();
  while (Clock::now() - t0 < timeout) {
    if (Running(c.WorkerStats(i)) > 0) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

// The whole answer of `r` by streaming (Follow), uninterrupted.
std::vector<int32_t> Reference(client::Client& c, const rpc::GenerateRequest& r) {
  auto id = c.Generate(r);
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok()) return {};
  std::vector<int32_t> ids;
  auto last =
      c.Follow(*id, 0, [&](const rpc::GenerateChunk& ch) { ids.insert(ids.end(), ch.ids.begin(), ch.ids.end()); });
  EXPECT_TRUE(last.ok()) << last.status();
  return ids;
}

void KillCoordinator(Cluster& cluster) {
  cluster.coordinator().process->Signal(SIGKILL);
  ASSERT_TRUE(cluster.coordinator().process->Wait(10s).has_value());
}

// Kill -9 of the coordinator mid-stream, restarted at once on its data
// directory and port: the client's stream goes on (it reconnects and polls
// again at its offset) with exactly the tokens of an uninterrupted run; the
// worker's generation was claimed, not dropped; the tenant's usage
// counters did not reset.
TEST_F(Leases, AStreamContinuesAcrossACoordinatorKillAndRestart) {
  Cluster cluster(Options(8000));
  ASSERT_TRUE(cluster.StartWorker(0));
  const std::vector<std::string> data = {"--data-dir", cluster.dir() + "/data"};
  ASSERT_TRUE(cluster.StartCoordinator(data));
  const int port = cluster.coordinator().port;
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  const rpc::GenerateRequest r = Sampled(Question(40, 7), 120, 1234);
  const std::vector<int32_t> reference = Reference(*c, r);
  ASSERT_EQ(reference.size(), 120u);
  auto before = c->Stats();
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->requests, 1);
  EXPECT_EQ(before->generated_tokens, 120);

  auto id = c->Generate(r);
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<int32_t> got;
  bool restarted = false;
  auto last = c->Follow(*id, 0, [&](const rpc::GenerateChunk& ch) {
    got.insert(got.end(), ch.ids.begin(), ch.ids.end());
    if (!restarted && got.size() >= 20 && !ch.done) {
      restarted = true;
      KillCoordinator(cluster);
      ASSERT_TRUE(cluster.StartCoordinator(data, port));
    }
  });
  ASSERT_TRUE(restarted) << "the generation ended before the kill";
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->finish_reason, "length");
  EXPECT_EQ(got, reference) << "the stream after the restart differs from the uninterrupted run";
  // Claimed from the worker, not started again there.
  const rpc::WorkerStats ws = cluster.WorkerStats(0);
  EXPECT_EQ(ws.lease_expired, 0);
  EXPECT_EQ(ws.submitted, 2) << "the restarted coordinator started the generation again";
  EXPECT_TRUE(WaitIdle(cluster, 0, 5s).has_value());
  auto after = c->Stats();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->requests, 2);
  EXPECT_EQ(after->generated_tokens, 240);
  EXPECT_EQ(after->prompt_tokens, 2 * before->prompt_tokens);
}

// A coordinator killed and not restarted: the worker cancels its generation
// once the lease passes without a renewal (and not before). Restarted
// later on its data directory, the coordinator starts the generation again
// from its journal, and the client's stream still gets exactly the tokens
// of an uninterrupted run (seeded sampling).
TEST_F(Leases, AWorkerDropsAnUnrenewedGenerationAndARestartRunsItAgainIdentically) {
  constexpr int kLeaseMs = 1000;
  constexpr size_t kCompared = 120;
  Cluster cluster(Options(kLeaseMs));
  ASSERT_TRUE(cluster.StartWorker(0));
  const std::vector<std::string> data = {"--data-dir", cluster.dir() + "/data"};
  ASSERT_TRUE(cluster.StartCoordinator(data));
  const int port = cluster.coordinator().port;
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  // The uninterrupted run's first tokens (a seeded run's tokens do not
  // depend on max_new_tokens); the interrupted run is long, so it is still
  // generating whatever the machine's speed when its lease expires, and is
  // cancelled by the client once it has made kCompared tokens again.
  const std::vector<int32_t> reference = Reference(*c, Sampled(Question(30, 9), kCompared, 99));
  ASSERT_EQ(reference.size(), kCompared);

  auto id = c->Generate(Sampled(Question(30, 9), 20000, 99));
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<int32_t> got;
  bool killed = false, cancelled = false;
  auto last = c->Follow(*id, 0, [&](const rpc::GenerateChunk& ch) {
    got.insert(got.end(), ch.ids.begin(), ch.ids.end());
    if (killed && !cancelled && got.size() >= kCompared) {
      cancelled = true;
      Status s = c->Cancel(*id);
      EXPECT_TRUE(s.ok()) << s;
    }
    if (killed || got.size() < 10 || ch.done) return;
    killed = true;
    const Clock::time_point t0 = Clock::now();
    KillCoordinator(cluster);
    // Still running within the lease...
    const rpc::WorkerStats mid = cluster.WorkerStats(0);
    EXPECT_EQ(Running(mid), 1) << "the generation ended before its lease expired";
    // ... cancelled after it (the lease, a quarter of it for the worker's
    // look, and a margin).
    std::optional<std::chrono::milliseconds> idle = WaitIdle(cluster, 0, std::chrono::milliseconds(kLeaseMs) + 3s);
    ASSERT_TRUE(idle.has_value()) << "the generation outlived its lease";
    EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(kLeaseMs / 2)) << "cancelled long before the lease expired";
    const rpc::WorkerStats ws = cluster.WorkerStats(0);
    EXPECT_EQ(ws.lease_expired, 1);
    ASSERT_TRUE(cluster.StartCoordinator(data, port));
  });
  ASSERT_TRUE(killed) << "the generation ended before the kill";
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_TRUE(cancelled);
  EXPECT_EQ(last->finish_reason, "cancelled");
  ASSERT_GE(got.size(), kCompared);
  got.resize(kCompared);
  EXPECT_EQ(got, reference) << "the stream started again differs from the uninterrupted run";
  EXPECT_TRUE(WaitIdle(cluster, 0, 5s).has_value());
  EXPECT_EQ(cluster.WorkerStats(0).submitted, 3);  // the reference, the first run, the run started again
}

// The worker's lease calls, directly: owner ids are validated, Renew lists
// and renews only its owner's generations, renewing keeps them past the
// lease, and once the renewals stop they are cancelled and forgotten; a
// generation without an owner never expires.
TEST_F(Leases, TheWorkersLeaseCallsAreValidatedAndScopedToTheirOwner) {
  constexpr int kLeaseMs = 1000;
  Cluster cluster(Options(kLeaseMs));
  ASSERT_TRUE(cluster.StartWorker(0));
  auto w = cluster.WorkerClient(0);
  ASSERT_TRUE(w);
  auto code_of = [&](const std::function<void()>& call) {
    try {
      call();
    } catch (const rpc::PenumbraError& e) {
      return static_cast<int>(e.code);
    }
    return 0;
  };
  rpc::WorkerGenerateRequest g;
  g.prompt = Question(10, 1);
  g.max_new_tokens = 20000;
  g.owner_id = "owner-a";
  std::string owned, unowned;
  (*w)->Generate(owned, g);
  rpc::WorkerGenerateRequest bad = g;
  bad.owner_id = "bad owner!";
  std::string h;
  EXPECT_EQ(code_of([&] { (*w)->Generate(h, bad); }), static_cast<int>(rpc::ErrorCode::INVALID_ARGUMENT));
  std::vector<std::string> listed;
  EXPECT_EQ(code_of([&] { (*w)->Renew(listed, ""); }), static_cast<int>(rpc::ErrorCode::INVALID_ARGUMENT));
  EXPECT_EQ(code_of([&] { (*w)->Renew(listed, std::string(65, 'a')); }),
            static_cast<int>(rpc::ErrorCode::INVALID_ARGUMENT));
  (*w)->Renew(listed, "owner-b");
  EXPECT_TRUE(listed.empty());
  (*w)->Renew(listed, "owner-a");
  EXPECT_EQ(listed, std::vector<std::string>{owned});
  // Renewed for twice the lease: still running.
  for (int i = 0; i < 10; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(kLeaseMs / 5));
    (*w)->Renew(listed, "owner-a");
  }
  EXPECT_EQ(Running(cluster.WorkerStats(0)), 1) << "a renewed generation was cancelled";
  rpc::WorkerGenerateRequest free = g;
  free.owner_id = "";
  (*w)->Generate(unowned, free);
  // Renewals stop: cancelled and forgotten after the lease; the generation
  // without an owner goes on.
  const Clock::time_point t0 = Clock::now();
  while (Clock::now() - t0 < std::chrono::milliseconds(kLeaseMs) + 3s && cluster.WorkerStats(0).lease_expired == 0) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(cluster.WorkerStats(0).lease_expired, 1);
  rpc::TokenChunk ch;
  EXPECT_EQ(code_of([&] { (*w)->Poll(ch, owned, 0, 0); }), static_cast<int>(rpc::ErrorCode::NOT_FOUND));
  (*w)->Renew(listed, "owner-a");
  EXPECT_TRUE(listed.empty());
  // A whole lease passes (part of the scenario: nothing may end the
  // generation without an owner meanwhile).
  std::this_thread::sleep_for(std::chrono::milliseconds(kLeaseMs) + 500ms);
  (*w)->Poll(ch, unowned, 0, 0);
  EXPECT_FALSE(ch.done) << "a generation without an owner was ended";
  (*w)->Cancel(unowned);
  EXPECT_TRUE(WaitIdle(cluster, 0, 5s).has_value());
}

// A batch job's item generating when the coordinator is killed: after the
// restart it runs once (the old copy is cancelled, the job runs it again;
// never two copies), and cancelling the job leaves nothing on the worker.
TEST_F(Leases, AJobItemInFlightAtARestartRunsOnceAndItsCancelStopsIt) {
  Cluster cluster(Options(30000));  // the lease plays no part: recovery cancels the old copy
  ASSERT_TRUE(cluster.StartWorker(0));
  const std::vector<std::string> data = {"--data-dir", cluster.dir() + "/data", "--job-concurrency", "4"};
  ASSERT_TRUE(cluster.StartCoordinator(data));
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  rpc::SubmitJobRequest job;
  rpc::JobItem it;
  it.custom_id = "long";
  it.request = Sampled(Question(20, 3), 20000, 5);
  job.items.push_back(it);
  auto submitted = c->SubmitJob(job);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  ASSERT_TRUE(WaitBusy(cluster, 0, 20s)) << "the item never started";
  KillCoordinator(cluster);
  ASSERT_TRUE(cluster.StartCoordinator(data));
  c = cluster.Client();
  ASSERT_TRUE(c);
  // Watched for a while: exactly one copy runs (the re-run), never two. The
  // old copy's cancel lands at its next decode step, which a loaded machine
  // may take a while to reach: wait for it first (two copies that stay fail).
  ASSERT_TRUE(Eventually([&] { return Running(cluster.WorkerStats(0)) <= 1; }, 20s,
                         "the old copy's cancel to land (one copy running)"));
  int64_t most = 0;
  const Clock::time_point until = Clock::now() + 3s;
  bool seen = false;
  while (Clock::now() < until) {
    const int64_t n = Running(cluster.WorkerStats(0));
    most = std::max(most, n);
    seen = seen || n == 1;
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(most, 1) << "two copies of the item ran at once";
  EXPECT_TRUE(seen) << "the item did not run after the restart";
  auto cancelled = c->CancelJob(submitted->id);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_TRUE(WaitIdle(cluster, 0, 5s).has_value()) << "a copy of the cancelled job's item still runs";
  const Clock::time_point t0 = Clock::now();
  rpc::JobInfo info;
  while (Clock::now() - t0 < 10s) {
    auto j = c->GetJob(submitted->id);
    ASSERT_TRUE(j.ok()) << j.status();
    info = *j;
    if (info.status == rpc::JobStatus::CANCELLED) break;
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(info.status, rpc::JobStatus::CANCELLED);
  EXPECT_EQ(info.completed + info.failed + info.cancelled, 1) << "the item was answered more than once (or never)";
  const rpc::WorkerStats ws = cluster.WorkerStats(0);
  EXPECT_EQ(ws.submitted, 2);  // the first copy and the re-run
  EXPECT_EQ(ws.cancelled, 2);
}

// SIGTERM with a drain shorter than the running generation: the coordinator
// cancels it on the worker when the drain expires (the lease is long: only
// the drain's cancel can end it in time).
TEST_F(Leases, AnExpiredDrainLeavesNoGenerationOnTheWorkers) {
  Cluster cluster(Options(60000));
  ASSERT_TRUE(cluster.StartWorker(0));
  ASSERT_TRUE(cluster.StartCoordinator({"--drain-seconds", "1"}));
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  auto id = c->Generate(Sampled(Question(20, 11), 20000, 8));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitBusy(cluster, 0, 20s));
  const Clock::time_point t0 = Clock::now();
  cluster.coordinator().process->Signal(SIGTERM);
  EXPECT_TRUE(cluster.coordinator().process->Wait(10s).has_value()) << "the coordinator did not exit";
  EXPECT_TRUE(WaitIdle(cluster, 0, 2s).has_value()) << "the generation outlived the drain";
  EXPECT_LT(Clock::now() - t0, 8s);
  EXPECT_EQ(cluster.WorkerStats(0).cancelled, 1);
}

// SIGTERM to a worker whose drain expires: what it still runs is cancelled
// then, not left generating while the worker waits for its answers to be
// read (up to 10 s more).
TEST_F(Leases, AnExpiredWorkerDrainCancelsWhatIsLeft) {
  ClusterOptions o = Options(60000);
  o.worker_flags.insert(o.worker_flags.end(), {"--drain-seconds", "2"});
  Cluster cluster(o);
  ASSERT_TRUE(cluster.StartWorker(0));
  ASSERT_TRUE(cluster.StartCoordinator());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  auto id = c->Generate(Sampled(Question(20, 19), 20000, 3));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitBusy(cluster, 0, 20s));
  const int port = cluster.worker(0).port;
  const Clock::time_point t0 = Clock::now();
  cluster.worker(0).process->Signal(SIGTERM);
  std::this_thread::sleep_for(2600ms);  // the drain (2 s) has expired
  // Gone, or still up (waiting for answers to be read) with nothing running.
  bool idle = false;
  while (!idle && Clock::now() - t0 < 4s) {
    if (!cluster.worker(0).process->running()) {
      idle = true;
      break;
    }
    auto w = transport::ThriftClient<rpc::WorkerClient>::Connect("127.0.0.1", port, 2s);
    if (!w.ok()) {  // exiting
      std::this_thread::sleep_for(50ms);
      continue;
    }
    rpc::WorkerStats s;
    try {
      (**w)->Stats(s);
      idle = Running(s) == 0;
    } catch (const std::exception&) {
    }
    if (!idle) std::this_thread::sleep_for(100ms);
  }
  EXPECT_TRUE(idle) << "the worker kept generating after its drain expired";
  bool exited = !cluster.worker(0).process->running();
  if (!exited) exited = cluster.worker(0).process->Wait(15s).has_value();
  EXPECT_TRUE(exited) << "the worker did not exit";
}

// A Complete whose client closes its connection: its generation is
// cancelled (the lease is long: only noticing the hang-up ends it in time).
TEST_F(Leases, ACompleteWhoseClientHangsUpLeavesNoGeneration) {
  Cluster cluster(Options(60000));
  ASSERT_TRUE(cluster.StartWorker(0));
  ASSERT_TRUE(cluster.StartCoordinator());
  {
    // A raw client whose call gives up after a second and closes its socket.
    auto raw = transport::ThriftClient<rpc::PenumbraClient>::Connect("127.0.0.1", cluster.coordinator().port, 1s);
    ASSERT_TRUE(raw.ok()) << raw.status();
    rpc::GenerateChunk out;
    bool timed_out = false;
    try {
      (**raw)->Complete(out, Sampled(Question(20, 13), 20000, 4));
    } catch (const std::exception&) {
      timed_out = true;
    }
    ASSERT_TRUE(timed_out) << "the Complete returned";
    EXPECT_EQ(Running(cluster.WorkerStats(0)), 1) << "the generation did not start";
  }  // closed here
  EXPECT_TRUE(WaitIdle(cluster, 0, 4s).has_value()) << "the generation outlived its client's connection";
  EXPECT_EQ(cluster.WorkerStats(0).cancelled, 1);
}

// A stream nobody polls past the abandon timeout is cancelled.
TEST_F(Leases, AStreamNobodyPollsIsCancelled) {
  Cluster cluster(Options(60000));
  ASSERT_TRUE(cluster.StartWorker(0));
  ASSERT_TRUE(cluster.StartCoordinator({"--abandon-timeout-s", "2"}));
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  auto id = c->Generate(Sampled(Question(20, 17), 20000, 6));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitBusy(cluster, 0, 20s));
  const Clock::time_point t0 = Clock::now();
  EXPECT_TRUE(WaitIdle(cluster, 0, 6s).has_value()) << "the abandoned generation still runs";
  EXPECT_GE(Clock::now() - t0, 1s) << "cancelled before the abandon timeout";
  auto ch = c->Poll(*id, 0, 0);
  ASSERT_TRUE(ch.ok()) << ch.status();
  EXPECT_TRUE(ch->done);
  EXPECT_EQ(ch->finish_reason, "cancelled");
}

}  // namespace
}  // namespace penumbra::testing
