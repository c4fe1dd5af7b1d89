// The coordinator's view of its workers: one control-API connection pool per
// worker (Thrift clients are not thread-safe: a call borrows one), health
// checked in the background, and the load the coordinator itself placed on
// each (requests routed there and not yet finished), which routing reads.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "gen-cpp/Worker.h"
#include "transport/thrift_util.h"

namespace penumbra::coordinator {

struct WorkerEndpoint {
  std::string name;
  std::string host;
  int port = 0;
  // A rank of a context group (docs/architecture.md, "Worker groups"):
  // the group's name, this worker's rank and the group's size. "": a single
  // worker.
  std::string group;
  int rank = 0, world = 1;
  std::string address() const { return host + ":" + std::to_string(port); }
};

// "host:port" or "name=host:port"; InvalidArgument naming the text.
Result<WorkerEndpoint> ParseWorkerEndpoint(const std::string& text, const std::string& default_name);
// Context groups: "NAME=[NAME=]HOST:PORT,...;NAME=...": each group's ranks
// in rank order (2 or more; members unnamed are NAME.rR). InvalidArgument
// naming the text.
Result<std::vector<WorkerEndpoint>> ParseGroups(const std::string& text);

struct WorkerPoolOptions {
  std::chrono::milliseconds connect_timeout{2000};
  std::chrono::milliseconds call_timeout{30000};
  std::chrono::milliseconds health_interval{1000};
  transport::ThriftLimits limits;
  // Mutual TLS to the workers (their certificates must have role worker and
  // name the host dialled); null: plaintext (a loopback development setup).
  std::shared_ptr<const transport::TlsClientContext> tls;
  // A pooled connection idle longer than this is closed instead of reused
  // (workers close connections idle past their idle timeout, 300 s by
  // default; reusing one the worker has closed would fail the call).
  std::chrono::milliseconds max_idle{60000};
  // The coordinator's owner id (WorkerGenerateRequest.owner_id): each health
  // check also renews its lease on the worker's generations (Renew), so
  // health_interval must stay well under the workers' --lease-ms. "": no
  // renewals. Default: "".
  std::string owner_id;
  // A group is formed (JoinGroup on each rank) when every rank answers and
  // they are not all in one formation; a formation still forming this long
  // after it was started is started again. Default: 60 s.
  std::chrono::milliseconds group_form_timeout{60000};
};

struct WorkerState {
  WorkerEndpoint endpoint;
  bool healthy = false;
  std::string error;         // why not healthy
  rpc::WorkerHealth health;  // the last answered
  rpc::WorkerStats stats;
  int64_t routed = 0;  // requests placed here by the coordinator and not finished
  // A group's rank 0: every rank answers and all are formed in one
  // formation (the group takes requests through this worker).
  bool group_formed = false;
};

// A context group as the coordinator sees it.
struct GroupState {
  std::string name;
  std::vector<int> members;  // worker indices, in rank order
  bool formed = false;
  int64_t epoch = 0;       // the formation its ranks report (when formed)
  int64_t formations = 0;  // formations this coordinator started
  std::string error;       // why it is not formed
};

using WorkerClient = transport::ThriftClient<rpc::WorkerClient>;

class WorkerPool {
 public:
  // Checks every worker once (an unreachable one starts unhealthy) and
  // starts the health thread.
  static Result<std::unique_ptr<WorkerPool>> Create(std::vector<WorkerEndpoint> workers,
                                                    const WorkerPoolOptions& options);
  ~WorkerPool();

  int size() const { return static_cast<int>(workers_.size()); }
  WorkerState state(int i) const;
  std::vector<WorkerState> states() const;

  // Runs `call` on a pooled connection of worker i with `timeout` (0: the
  // pool's call timeout). PenumbraErrors come back as their Status; a
  // transport failure drops the connection and marks the worker unhealthy
  // (Unavailable), a timeout is DeadlineExceeded.
  Status Call(int i, const std::string& what, const std::function<void(rpc::WorkerClient&)>& call,
              std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  void AddRouted(int i, int64_t delta);
  // Checks worker i now (as the health thread does; with an owner id, also
  // renews its lease there).
  void CheckNow(int i);
  // Renews the owner's lease on worker i now and returns the handles of the
  // owner's generations there (see Worker.Renew).
  Result<std::vector<std::string>> Renew(int i);
  // The index of the worker named `name`; -1 when none is.
  int Find(const std::string& name) const;
  std::vector<GroupState> groups() const;
  // Checks every rank of the group worker i is rank 0 of and forms it when
  // it is not formed (the health thread does it after each round).
  void CheckGroup(int leader);
  const std::string& owner_id() const { return o_.owner_id; }

 private:
  struct Worker {
    WorkerEndpoint endpoint;
    mutable std::mutex mu;
    std::vector<std::unique_ptr<WorkerClient>> idle;
    WorkerState state;
  };
  explicit WorkerPool(const WorkerPoolOptions& o) : o_(o) {}
  void HealthLoop();
  Result<std::unique_ptr<WorkerClient>> Borrow(Worker& w);
  void MarkUnhealthy(Worker& w, const std::string& why);

  struct Group {
    GroupState state;
    std::chrono::steady_clock::time_point started{};  // the latest formation this coordinator started
  };
  // Starts formation g.epoch of group g (under nothing; the health thread).
  void Form(const GroupState& g);

  WorkerPoolOptions o_;
  std::vector<std::unique_ptr<Worker>> workers_;
  mutable std::mutex groups_mu_;
  std::vector<Group> groups_;  // guarded by groups_mu_
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread health_;
};

}  // namespace penumbra::coordinator
