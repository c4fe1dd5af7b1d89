#include "coordinator/server/worker_pool.h"

#include <glog/logging.h>

namespace penumbra::coordinator {

Result<WorkerEndpoint> ParseWorkerEndpoint(const std::string& text, const std::string& default_name) {
  WorkerEndpoint e;
  std::string rest = text;
  const size_t eq = rest.find('=');
  e.name = default_name;
  if (eq != std::string::npos) {
    e.name = rest.substr(0, eq);
    rest = rest.substr(eq + 1);
  }
  const size_t colon = rest.rfind(':');
  if (e.name.empty() || colon == std::string::npos || colon == 0 || colon + 1 >= rest.size()) {
    return Status::InvalidArgument("worker address '" + text + "' is not [name=]host:port");
  }
  e.host = rest.substr(0, colon);
  const std::string port = rest.substr(colon + 1);
  if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) < 1 ||
      std::stoi(port) > 65535) {
    return Status::InvalidArgument("worker address '" + text + "': port must be in [1, 65535]");
  }
  e.port = std::stoi(port);
  return e;
}

Result<std::unique_ptr<WorkerPool>> WorkerPool::Create(std::vector<WorkerEndpoint> workers,
                                                       const WorkerPoolOptions& options) {
  if (workers.empty()) return Status::InvalidArgument("no workers");
  auto p = std::unique_ptr<WorkerPool>(new WorkerPool(options));
  for (auto& e : workers) {
    for (const auto& w : p->workers_) {
      if (w->endpoint.name == e.name) return Status::InvalidArgument("two workers are named '" + e.name + "'");
    }
    auto w = std::make_unique<Worker>();
    w->endpoint = e;
    w->state.endpoint = e;
    w->state.error = "not checked yet";
    p->workers_.push_back(std::move(w));
  }
  for (int i = 0; i < p->size(); ++i) p->CheckNow(i);
  p->health_ = std::thread([raw = p.get()] { raw->HealthLoop(); });
  return p;
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lk(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (health_.joinable()) health_.join();
}

WorkerState WorkerPool::state(int i) const {
  std::lock_guard<std::mutex> lk(workers_[i]->mu);
  return workers_[i]->state;
}

std::vector<WorkerState> WorkerPool::states() const {
  std::vector<WorkerState> s;
  for (int i = 0; i < size(); ++i) s.push_back(state(i));
  return s;
}

void WorkerPool::AddRouted(int i, int64_t delta) {
  std::lock_guard<std::mutex> lk(workers_[i]->mu);
  workers_[i]->state.routed += delta;
}

Result<std::unique_ptr<WorkerClient>> WorkerPool::Borrow(Worker& w) {
  {
    std::lock_guard<std::mutex> lk(w.mu);
    const auto now = std::chrono::steady_clock::now();
    while (!w.idle.empty()) {
      auto c = std::move(w.idle.back());
      w.idle.pop_back();
      if (now - c->last_used() < o_.max_idle) return c;
    }
  }
  return WorkerClient::Connect(w.endpoint.host, w.endpoint.port, o_.connect_timeout, o_.limits, o_.tls);
}

void WorkerPool::MarkUnhealthy(Worker& w, const std::string& why) {
  std::lock_guard<std::mutex> lk(w.mu);
  if (w.state.healthy) LOG(WARNING) << "worker " << w.endpoint.name << " (" << w.endpoint.address() << "): " << why;
  w.state.healthy = false;
  w.state.error = why;
  w.idle.clear();  // the other connections are likely dead too
}

Status WorkerPool::Call(int i, const std::string& what, const std::function<void(rpc::WorkerClient&)>& call,
                        std::chrono::milliseconds timeout) {
  Worker& w = *workers_[i];
  const std::string where = "worker " + w.endpoint.name + " (" + w.endpoint.address() + "): " + what;
  Result<std::unique_ptr<WorkerClient>> c = Borrow(w);
  if (!c.ok()) {
    MarkUnhealthy(w, c.status().message());
    return Status::Unavailable(where + ": " + c.status().message());
  }
  (*c)->SetTimeout(timeout.count() > 0 ? timeout : o_.call_timeout);
  try {
    call(***c);
  } catch (const rpc::PenumbraError& e) {
    std::lock_guard<std::mutex> lk(w.mu);
    w.idle.push_back(std::move(*c));  // the connection is fine
    return transport::FromRpcError(e);
  } catch (const std::exception& e) {
    Status s = transport::FromThriftException(e, where);
    if (s.code() == StatusCode::kUnavailable) MarkUnhealthy(w, s.message());
    return s;  // the connection is dropped (its state is unknown)
  }
  std::lock_guard<std::mutex> lk(w.mu);
  w.idle.push_back(std::move(*c));
  return Status::OK();
}

void WorkerPool::CheckNow(int i) {
  Worker& w = *workers_[i];
  rpc::WorkerHealth h;
  rpc::WorkerStats st;
  std::vector<std::string> handles;
  Status s = Call(
      i, "health",
      [&](rpc::WorkerClient& c) {
        c.Health(h);
        c.Stats(st);
        if (!o_.owner_id.empty()) c.Renew(handles, o_.owner_id);
      },
      o_.connect_timeout);
  std::lock_guard<std::mutex> lk(w.mu);
  if (!s.ok()) {
    w.state.healthy = false;
    w.state.error = s.message();
    return;
  }
  if (!w.state.healthy && h.serving)
    LOG(INFO) << "worker " << w.endpoint.name << " (" << w.endpoint.address() << ") is up";
  w.state.health = h;
  w.state.stats = st;
  w.state.healthy = h.serving;
  w.state.error = h.serving ? "" : "draining";
}

Result<std::vector<std::string>> WorkerPool::Renew(int i) {
  std::vector<std::string> handles;
  if (o_.owner_id.empty()) return handles;
  PENUMBRA_RETURN_IF_ERROR(Call(i, "renew", [&](rpc::WorkerClient& c) { c.Renew(handles, o_.owner_id); }));
  return handles;
}

int WorkerPool::Find(const std::string& name) const {
  for (int i = 0; i < size(); ++i) {
    if (workers_[i]->endpoint.name == name) return i;
  }
  return -1;
}

void WorkerPool::HealthLoop() {
  std::unique_lock<std::mutex> lk(stop_mu_);
  while (!stop_cv_.wait_for(lk, o_.health_interval, [&] { return stop_; })) {
    lk.unlock();
    for (int i = 0; i < size(); ++i) CheckNow(i);
    lk.lock();
  }
}

}  // namespace penumbra::coordinator
