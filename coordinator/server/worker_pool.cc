#include "coordinator/server/worker_pool.h"

#include <sstream>

#include "common/crypto.h"

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

Result<std::vector<WorkerEndpoint>> ParseGroups(const std::string& text) {
  std::vector<WorkerEndpoint> out;
  std::stringstream groups(text);
  std::string g;
  while (std::getline(groups, g, ';')) {
    if (g.empty()) continue;
    const size_t eq = g.find('=');
    if (eq == std::string::npos || eq == 0) {
      return Status::InvalidArgument("group '" + g + "' is not NAME=HOST:PORT,HOST:PORT,...");
    }
    const std::string name = g.substr(0, eq);
    std::vector<WorkerEndpoint> ranks;
    std::stringstream members(g.substr(eq + 1));
    std::string m;
    while (std::getline(members, m, ',')) {
      if (m.empty()) continue;
      PENUMBRA_ASSIGN_OR_RETURN(WorkerEndpoint e, ParseWorkerEndpoint(m, name + ".r" + std::to_string(ranks.size())));
      e.group = name;
      e.rank = static_cast<int>(ranks.size());
      ranks.push_back(e);
    }
    if (ranks.size() < 2) return Status::InvalidArgument("group '" + name + "' needs 2 or more ranks");
    for (WorkerEndpoint& e : ranks) e.world = static_cast<int>(ranks.size());
    for (const WorkerEndpoint& e : out) {
      if (e.group == name) return Status::InvalidArgument("two groups are named '" + name + "'");
    }
    out.insert(out.end(), ranks.begin(), ranks.end());
  }
  return out;
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
  // Groups: their ranks in order, each group's rank 0 first.
  for (int i = 0; i < p->size(); ++i) {
    const WorkerEndpoint& e = p->workers_[i]->endpoint;
    if (e.group.empty() || e.rank != 0) continue;
    Group g;
    g.state.name = e.group;
    g.state.error = "not formed yet";
    for (int r = 0; r < e.world; ++r) {
      int found = -1;
      for (int j = 0; j < p->size(); ++j) {
        const WorkerEndpoint& m = p->workers_[j]->endpoint;
        if (m.group == e.group && m.rank == r) found = j;
      }
      if (found < 0) return Status::InvalidArgument("group '" + e.group + "' has no rank " + std::to_string(r));
      g.state.members.push_back(found);
    }
    p->groups_.push_back(std::move(g));
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
  for (;;) {
    lk.unlock();
    for (int i = 0; i < size(); ++i) CheckNow(i);
    std::vector<int> leaders;
    {
      std::lock_guard<std::mutex> g(groups_mu_);
      for (const Group& x : groups_) leaders.push_back(x.state.members[0]);
    }
    for (int l : leaders) CheckGroup(l);
    lk.lock();
    if (stop_cv_.wait_for(lk, o_.health_interval, [&] { return stop_; })) return;
  }
}

std::vector<GroupState> WorkerPool::groups() const {
  std::lock_guard<std::mutex> lk(groups_mu_);
  std::vector<GroupState> out;
  for (const Group& g : groups_) out.push_back(g.state);
  return out;
}

void WorkerPool::CheckGroup(int leader) {
  std::unique_lock<std::mutex> lk(groups_mu_);
  Group* g = nullptr;
  for (Group& x : groups_) {
    if (x.state.members[0] == leader) g = &x;
  }
  if (g == nullptr) return;
  // What every rank reported at its last health check.
  bool answering = true, formed = true, forming = false;
  int64_t epoch = -1, newest = 0;
  std::string why;
  for (int m : g->state.members) {
    const WorkerState st = state(m);
    const rpc::WorkerGroupState& r = st.health.group;
    if (!st.healthy) {
      answering = false;
      if (why.empty()) why = "rank " + std::to_string(st.endpoint.rank) + " (" + st.endpoint.name + "): " + st.error;
      continue;
    }
    if (!st.health.__isset.group || r.name != g->state.name || r.rank != st.endpoint.rank ||
        r.world != st.endpoint.world) {
      answering = false;
      if (why.empty())
        why = "worker " + st.endpoint.name + " is not rank " + std::to_string(st.endpoint.rank) + " of group " +
              g->state.name + " (its --group flags)";
      continue;
    }
    newest = std::max(newest, r.epoch);
    if (r.state == "forming") forming = true;
    if (r.state != "formed" || (epoch >= 0 && r.epoch != epoch)) {
      formed = false;
      if (why.empty()) {
        why = "rank " + std::to_string(r.rank) + " is " + r.state + (r.error.empty() ? "" : " (" + r.error + ")");
      }
    }
    epoch = r.epoch;
  }
  formed = formed && answering;
  if (formed != g->state.formed) {
    LOG(INFO) << "group " << g->state.name
              << (formed ? " formed (formation " + std::to_string(epoch) + ")" : " not formed: " + why);
  }
  g->state.formed = formed;
  g->state.epoch = formed ? epoch : g->state.epoch;
  g->state.error = formed ? "" : why;
  {
    std::lock_guard<std::mutex> w(workers_[leader]->mu);
    workers_[leader]->state.group_formed = formed;
  }
  if (formed || !answering) return;
  // Not formed but every rank answers: formed again, unless a formation of
  // ours is still under way.
  const auto now = std::chrono::steady_clock::now();
  if (forming && now - g->started < o_.group_form_timeout) return;
  g->state.epoch = std::max(newest, g->state.epoch) + 1;
  g->started = now;
  ++g->state.formations;
  const GroupState formation = g->state;
  lk.unlock();
  Form(formation);
}

void WorkerPool::Form(const GroupState& g) {
  rpc::WorkerJoinGroup j;
  j.name = g.name;
  j.epoch = g.epoch;
  j.world = static_cast<int32_t>(g.members.size());
  j.secret = RandomHandle();  // 128 bits, this formation's: every rank proves it holds it
  std::string rendezvous;
  for (size_t r = 0; r < g.members.size(); ++r) {
    j.rank = static_cast<int32_t>(r);
    j.rendezvous = r == 0 ? "" : rendezvous;
    std::string answer;
    Status s = Call(g.members[r], "join group", [&](rpc::WorkerClient& c) { c.JoinGroup(answer, j); });
    if (!s.ok()) {
      LOG(WARNING) << "group " << g.name << ": formation " << j.epoch << ", rank " << r << ": " << s;
      return;
    }
    if (r == 0) rendezvous = answer;
  }
  LOG(INFO) << "group " << g.name << ": formation " << j.epoch << " started (rank 0 at " << rendezvous << ")";
}

}  // namespace penumbra::coordinator
