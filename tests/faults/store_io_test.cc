// A store node stopped (SIGSTOP) under a worker that reads and writes
// documents on it (issue 38, "storeio"): real penumbra-store and
// penumbra-worker processes on loopback. The worker's store calls have short
// deadlines and a circuit breaker (flags); its lookups run off the decode
// loop. The node is stopped for 2 s and let go on for 1 s, four times;
// while it is stopped:
//   - the requests that do not touch it keep decoding at their rate (tokens
//     per second over half-second windows: the median of the windows while
//     it is stopped at least 80% of the median of the windows while it runs,
//     interleaved so that a drift of the machine's load shows in both);
//   - the requests that read a document from it, or write a new one to it,
//     finish within the deadline, prefilled from their tokens;
//   - the node's breaker opens (calls fail at once, counted);
// after SIGCONT the breaker closes again and documents are read from the
// node once more.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>

#include "tests/service/service_cluster.h"
#include "tests/worker/stories_shadowkv.h"
#include "transport/worker_documents.h"

namespace penumbra::testing {
namespace {

using namespace std::chrono_literals;
using SteadyClock = std::chrono::steady_clock;
using WorkerConn = std::unique_ptr<transport::ThriftClient<rpc::WorkerClient>>;

class StoreIo : public StoriesTest {};

constexpr int kDocTokens = 64;
constexpr int kCallTimeoutMs = 1000;

Status Submit(WorkerConn& w, const std::vector<int32_t>& prompt, std::vector<int64_t> document_ends, int max_new,
              std::string* id) {
  rpc::WorkerGenerateRequest g;
  g.max_new_tokens = max_new;
  if (max_new == 0) {  // a put
    rpc::WorkerPutRequest p;
    p.documents = transport::DocumentsOf(prompt, document_ends);
    return transport::CallRpc("put", [&] { (*w)->PutDocument(*id, p); });
  }
  transport::SetPrompt(&g, prompt, document_ends);
  return transport::CallRpc("generate", [&] { (*w)->Generate(*id, g); });
}

// Polls `id` until it is done (at most `limit`); false on an RPC failure or
// the limit.
bool WaitDone(WorkerConn& w, const std::string& id, std::chrono::milliseconds limit, rpc::TokenChunk* out) {
  const auto until = SteadyClock::now() + limit;
  while (SteadyClock::now() < until) {
    Status s = transport::CallRpc("poll", [&] { (*w)->Poll(*out, id, 0, 100); });
    if (!s.ok()) return false;
    if (out->done) {
      (void)transport::CallRpc("release", [&] { (*w)->Release(id); });
      return true;
    }
  }
  return false;
}

// One request that touches the node, as the toucher saw it.
struct Touch {
  bool read = false;  // a stored document read (else a new document written)
  int phase_submitted = 0, phase_finished = 0;
  int epoch_submitted = 0, epoch_finished = 0;  // the phase's number (one per change)
  double seconds = 0;                           // submitted -> done
  bool done = false;
  std::string reason, error;
  int64_t cached = 0;
};

enum Phase { kWarmUp = 0, kRunning = 1, kStopped = 2, kRecovering = 3, kEnd = 4 };

TEST_F(StoreIo, AStoppedStoreNodeCostsOnlyTheRequestsThatNeedIt) {
  char tmpl[] = "/tmp/penumbra-store-io-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  Served node;
  node.process = Process::Start({BinDir() + "/penumbra-store", "--path", dir + "/db", "--port-file", dir + "/port"},
                                dir + "/store.log");
  ASSERT_TRUE(WaitServing(node, dir + "/port"));
  const std::string node_name = "127.0.0.1:" + std::to_string(node.port);
  ClusterOptions o;
  o.workers = 2;
  o.worker_flags = {"--store-node",
                    node_name,
                    "--store-call-timeout-ms",
                    std::to_string(kCallTimeoutMs),
                    "--store-breaker-failures",
                    "2",
                    "--store-breaker-cooldown-ms",
                    "1000"};
  Cluster cluster(o);
  // w0 writes the documents to the node; w1 (nothing in memory) serves.
  ASSERT_TRUE(cluster.StartWorker(0));
  ASSERT_TRUE(cluster.StartWorker(1));
  const int metrics = cluster.worker(1).metrics_port;
  const std::string label = "{node=\"" + node_name + "\"}";

  // Stored documents: put on w0 (prefill only), each written to the node in
  // the background; the last one is the canary w1 reads. A write the node
  // did not take (a first connection that timed out on a loaded machine, and
  // the breaker it opened) is not retried by the worker, which holds the
  // document in memory: the setup waits out the breaker and puts another.
  constexpr int kDocs = 60;
  std::vector<uint64_t> seeds;  // the documents the node holds, by their seed
  auto doc = [&](int k) { return LcgTokens(kDocTokens, seeds[k], true); };
  {
    auto w0 = cluster.WorkerClient(0);
    ASSERT_TRUE(w0);
    int64_t stored = cluster.WorkerStats(0).documents_stored;
    for (uint64_t seed = 1000; static_cast<int>(seeds.size()) <= kDocs; ++seed) {
      ASSERT_LT(seed, 1000u + 3 * kDocs) << "the node took " << seeds.size() << " of " << (seed - 1000) << " documents";
      std::string id;
      ASSERT_TRUE(Submit(w0, LcgTokens(kDocTokens, seed, true), {kDocTokens}, 0, &id).ok());
      rpc::TokenChunk c;
      ASSERT_TRUE(WaitDone(w0, id, 30s, &c));
      ASSERT_EQ(c.finish_reason, "prefilled");
      if (Eventually([&] { return cluster.WorkerStats(0).documents_stored > stored; }, 5s, "w0's write")) {
        stored = cluster.WorkerStats(0).documents_stored;
        seeds.push_back(seed);
      } else {
        std::this_thread::sleep_for(1100ms);  // the breaker's cooldown
        stored = cluster.WorkerStats(0).documents_stored;
      }
    }
  }
  auto ask = [&](int k, uint64_t seed) {
    std::vector<int32_t> p = doc(k);
    const std::vector<int32_t> q = LcgTokens(6, seed, false);
    p.insert(p.end(), q.begin(), q.end());
    return p;
  };
  {
    auto w1 = cluster.WorkerClient(1);
    ASSERT_TRUE(w1);
    std::string id;
    ASSERT_TRUE(Submit(w1, ask(kDocs, 90), {kDocTokens}, 2, &id).ok());
    rpc::TokenChunk c;
    ASSERT_TRUE(WaitDone(w1, id, 30s, &c));
    const bool stored = c.usage.cached_prompt_tokens == kDocTokens;  // only the node could attach it
    ASSERT_TRUE(stored) << "w0's documents did not reach the store node";
  }

  std::atomic<int> phase{kWarmUp}, epoch{0};
  std::atomic<bool> stop{false};
  // Steady load that never touches the node: 4 requests without documents,
  // each replaced when it ends.
  std::atomic<int64_t> steady_done{0}, steady_bad{0};
  std::thread steady([&] {
    auto w = cluster.WorkerClient(1);
    if (!w) return;
    struct Slot {
      std::string id;
      uint64_t seed;
    };
    std::vector<Slot> slots(4);
    uint64_t seed = 1;
    auto start = [&](Slot& s) {
      s.seed = seed++;
      if (!Submit(w, LcgTokens(8, s.seed, true), {}, 400, &s.id).ok()) ++steady_bad;
    };
    for (auto& s : slots) start(s);
    while (!stop) {
      for (auto& s : slots) {
        rpc::TokenChunk c;
        if (!transport::CallRpc("poll", [&] { (*w)->Poll(c, s.id, 0, 0); }).ok()) {
          ++steady_bad;
          continue;
        }
        if (!c.done) continue;
        if (c.finish_reason != "length") ++steady_bad;
        ++steady_done;
        (void)transport::CallRpc("release", [&] { (*w)->Release(s.id); });
        start(s);
      }
      std::this_thread::sleep_for(20ms);
    }
  });
  // Requests that touch the node, one every 400 ms (a few: each one
  // prefilled instead of read is prefill work the batch waits for, as with
  // any store):
  // questions about stored documents (reads) and new documents (writes).
  std::mutex touches_mu;
  std::vector<Touch> touches;
  std::atomic<int> next_doc{0};
  std::thread toucher([&] {
    auto w = cluster.WorkerClient(1);
    if (!w) return;
    struct Pending {
      std::string id;
      Touch t;
      SteadyClock::time_point t0;
    };
    std::vector<Pending> pending;
    auto next_submit = SteadyClock::now();
    bool docs_left = true;
    for (int n = 0; !stop || !pending.empty();) {
      if (!stop && docs_left && SteadyClock::now() >= next_submit) {
        next_submit += 400ms;
        Pending p;
        p.t0 = SteadyClock::now();
        // Two reads for a write; while recovering, only reads (the node's
        // return is seen by one).
        p.t.read = n % 3 != 2 || phase == kRecovering;
        std::vector<int32_t> prompt;
        if (p.t.read) {
          const int k = next_doc++;
          docs_left = k + 1 < kDocs;
          prompt = ask(k, 500 + n);
        } else {
          prompt = LcgTokens(kDocTokens, 7000 + n, true);  // new: written to the node once prefilled
          const std::vector<int32_t> q = LcgTokens(6, 800 + n, false);
          prompt.insert(prompt.end(), q.begin(), q.end());
        }
        ++n;
        p.t.phase_submitted = phase;
        p.t.epoch_submitted = epoch;
        Status s = Submit(w, prompt, {kDocTokens}, 4, &p.id);
        if (s.ok()) {
          pending.push_back(std::move(p));
        } else {
          p.t.error = s.ToString();
          std::lock_guard<std::mutex> l(touches_mu);
          touches.push_back(p.t);
        }
      }
      for (auto it = pending.begin(); it != pending.end();) {
        rpc::TokenChunk c;
        Status s = transport::CallRpc("poll", [&] { (*w)->Poll(c, it->id, 0, 0); });
        const bool late = SteadyClock::now() - it->t0 > 20s;
        if (s.ok() && !c.done && !late) {
          ++it;
          continue;
        }
        Touch& t = it->t;
        t.done = s.ok() && c.done;
        t.reason = c.finish_reason;
        t.cached = c.usage.cached_prompt_tokens;
        if (!s.ok()) t.error = s.ToString();
        if (c.__isset.error_message) t.error = c.error_message;
        if (late) t.error += " (not done in 20 s)";
        t.seconds = std::chrono::duration<double>(SteadyClock::now() - it->t0).count();
        t.phase_finished = phase;
        t.epoch_finished = epoch;
        (void)transport::CallRpc("release", [&] { (*w)->Release(it->id); });
        {
          std::lock_guard<std::mutex> l(touches_mu);
          touches.push_back(t);
        }
        it = pending.erase(it);
      }
      std::this_thread::sleep_for(10ms);
    }
  });

  // Tokens per second over half-second windows (the worker's count of
  // generated tokens: the steady requests' and the few of the toucher's).
  auto stats = cluster.WorkerClient(1);
  ASSERT_TRUE(stats);
  auto generated = [&] {
    rpc::WorkerStats s;
    (*stats)->Stats(s);
    return s.generated_tokens;
  };
  auto windows = [&](int n) {
    std::vector<double> rates;
    for (int i = 0; i < n; ++i) {
      const auto t0 = SteadyClock::now();
      const int64_t g0 = generated();
      std::this_thread::sleep_for(500ms);
      const int64_t g1 = generated();
      rates.push_back(static_cast<double>(g1 - g0) / std::chrono::duration<double>(SteadyClock::now() - t0).count());
    }
    return rates;
  };
  std::this_thread::sleep_for(1s);  // warm up
  // Windows with the node running and stopped, interleaved (a drift of the
  // machine's load shows in both): 1 s running, 2 s stopped (past the call
  // deadline: calls time out and the breaker opens), four times.
  std::vector<double> running, stopped;
  auto set_phase = [&](Phase p) {
    phase = p;
    ++epoch;
  };
  for (int cycle = 0; cycle < 4; ++cycle) {
    set_phase(kRunning);
    for (double r : windows(2)) running.push_back(r);
    set_phase(kStopped);
    node.process->Signal(SIGSTOP);
    for (double r : windows(4)) stopped.push_back(r);
    node.process->Signal(SIGCONT);
  }
  const double opens = MetricValue(metrics, "penumbra_store_node_breaker_opens_total" + label);
  const double timeouts = MetricValue(metrics, "penumbra_store_node_timeouts_total" + label);
  const double rejected = MetricValue(metrics, "penumbra_store_node_rejected_total" + label);
  set_phase(kRecovering);
  // The breaker closes (a probe after the cool-down) and a stored document
  // is read from the node again.
  bool recovered = false;
  const auto recover_until = SteadyClock::now() + 15s;
  while (!recovered && SteadyClock::now() < recover_until) {
    std::this_thread::sleep_for(100ms);
    std::lock_guard<std::mutex> l(touches_mu);
    for (const Touch& t : touches) {
      if (t.phase_submitted == kRecovering && t.read && t.done && t.cached == kDocTokens) recovered = true;
    }
  }
  const double state_after = MetricValue(metrics, "penumbra_store_node_breaker_state" + label);
  phase = kEnd;
  stop = true;
  steady.join();
  toucher.join();

  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : (v[(v.size() - 1) / 2] + v[v.size() / 2]) / 2;
  };
  auto show = [](const std::vector<double>& v) {
    std::ostringstream os;
    for (double x : v) os << static_cast<int64_t>(x) << " ";
    return os.str();
  };
  const std::string rates = "tokens/s with the node running: " + show(running) + "| stopped: " + show(stopped);
  {
    rpc::WorkerStats ws;
    (*stats)->Stats(ws);
    std::cout << rates << "\nw1: " << ws.decode_steps << " decode steps, " << ws.prefill_piece_max_seconds
              << " s the longest prefill piece, " << ws.generated_tokens << " tokens\n";
  }
  EXPECT_GT(median(running), 0) << rates;
  // The node stopped costs the steady requests at most 30% of their rate.
  // Some cost is real (the requests that touch the node prefill their
  // documents instead of reading them), and on a 2-core CI machine one
  // half-second window varies by +-30% (359 to 637 tokens/s running, seen
  // in CI). The failure this guards against is a decode loop that waits on
  // the stopped node: a 1 s call deadline per touch costs more than half the
  // rate, and leaves windows with next to nothing generated, which the
  // second check catches on its own.
  EXPECT_GE(median(stopped), 0.7 * median(running)) << rates;
  EXPECT_GE(*std::min_element(stopped.begin(), stopped.end()), 0.2 * median(running)) << rates;
  EXPECT_EQ(steady_bad.load(), 0);
  EXPECT_GT(steady_done.load(), 0);

  // The requests that touched the node while it was stopped finished,
  // prefilled, within the deadline (one lookup: one call's deadline, plus
  // their own work).
  int stopped_reads = 0, stopped_writes = 0, healthy_reads_attached = 0;
  for (const Touch& t : touches) {
    std::ostringstream what;
    what << (t.read ? "read" : "write") << " submitted in phase " << t.phase_submitted << ", finished in "
         << t.phase_finished << " after " << t.seconds << " s: " << t.reason << " " << t.error << ", cached "
         << t.cached;
    std::cout << what.str() << " (epochs " << t.epoch_submitted << "-" << t.epoch_finished << ")\n";
    EXPECT_TRUE(t.done) << what.str();
    EXPECT_EQ(t.reason, "length") << what.str();
    if (t.phase_submitted == kStopped && t.epoch_submitted == t.epoch_finished) {  // within one stop
      (t.read ? stopped_reads : stopped_writes)++;
      EXPECT_EQ(t.cached, 0) << what.str();  // nothing could come from the node
      EXPECT_LT(t.seconds, kCallTimeoutMs / 1000.0 + 2.0) << what.str();
    }
    if (t.phase_submitted == kRunning && t.epoch_submitted == 1 && t.read && t.cached == kDocTokens) {
      ++healthy_reads_attached;  // before the first stop
    }
  }
  EXPECT_GE(stopped_reads, 2);
  EXPECT_GE(stopped_writes, 1);
  EXPECT_GE(healthy_reads_attached, 1);  // before the first stop, documents came from the node
  // The breaker opened (calls past their deadline, then failed at once) ...
  EXPECT_GE(opens, 1);
  EXPECT_GE(timeouts, 1);
  EXPECT_GE(rejected, 1);
  // ... and closed again once the node answered: documents come from it.
  EXPECT_TRUE(recovered);
  EXPECT_EQ(state_after, 0);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace penumbra::testing
