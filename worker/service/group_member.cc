#include "worker/service/group_member.h"

#include <chrono>
#include <utility>

#include "common/logging.h"
#include "worker/parallel/context_group.h"

namespace penumbra::service {

GroupMember::GroupMember(Scheduler* scheduler, Runtime* runtime, GroupMemberOptions options)
    : s_(scheduler), rt_(runtime), o_(std::move(options)) {
  if (o_.rank == 0 && o_.world > 1) watch_ = std::thread([this] { WatchLoop(); });
}

GroupMember::~GroupMember() { Stop(); }

const char* GroupMember::StateName(Phase s) {
  switch (s) {
    case Phase::kUnformed:
      return "unformed";
    case Phase::kForming:
      return "forming";
    case Phase::kFormed:
      return "formed";
    case Phase::kBroken:
      return "broken";
  }
  return "unformed";
}

Result<std::string> ValidateJoin(const GroupMemberOptions& o, const rpc::WorkerJoinGroup& join) {
  if (o.name.empty()) return Status::FailedPrecondition("this worker is in no group (no --group)");
  if (join.name != o.name) {
    return Status::InvalidArgument("JoinGroup names group \"" + join.name + "\"; this worker is in \"" + o.name + "\"");
  }
  if (join.world != o.world || join.rank != o.rank) {
    return Status::InvalidArgument("JoinGroup names rank " + std::to_string(join.rank) + " of " +
                                   std::to_string(join.world) + "; this worker is rank " + std::to_string(o.rank) +
                                   " of " + std::to_string(o.world));
  }
  if (join.epoch <= 0) return Status::InvalidArgument("JoinGroup's epoch must be > 0");
  if (o.rank == 0 && !join.rendezvous.empty()) {
    return Status::InvalidArgument("JoinGroup: rank 0 listens (its rendezvous must be empty)");
  }
  if (o.rank > 0) {
    if (join.rendezvous.empty()) return Status::InvalidArgument("JoinGroup: a rank > 0 needs rank 0's rendezvous");
    std::string host;
    int port = 0;
    Status s = ParseRendezvous(join.rendezvous, &host, &port);
    if (!s.ok()) return Status::InvalidArgument("JoinGroup: " + s.message());
    if (port == 0) return Status::InvalidArgument("JoinGroup: rendezvous '" + join.rendezvous + "' has port 0");
  }
  Result<std::string> secret = ParseGroupSecret(join.secret);
  if (!secret.ok()) return Status::InvalidArgument("JoinGroup's secret: " + secret.status().message());
  return secret;
}

Result<std::string> GroupMember::Join(const rpc::WorkerJoinGroup& join) {
  Result<std::string> secret = ValidateJoin(o_, join);
  if (!secret.ok()) return secret.status();
  std::unique_ptr<CollectiveListener> listener;
  std::string rendezvous = join.rendezvous;
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_) return Status::Unavailable("the worker is stopping");
  if (join.epoch <= epoch_) {
    return Status::InvalidArgument("JoinGroup's epoch " + std::to_string(join.epoch) + " is not after this rank's " +
                                   std::to_string(epoch_));
  }
  if (joining_) return Status::Unavailable("a join of epoch " + std::to_string(epoch_) + " is under way");
  if (o_.rank == 0) {
    PENUMBRA_ASSIGN_OR_RETURN(listener, CollectiveListener::Bind(o_.host, 0));
    const bool v6 = o_.host.find(':') != std::string::npos;
    rendezvous = (v6 ? "[" + o_.host + "]" : o_.host) + ":" + std::to_string(listener->port());
  }
  epoch_ = join.epoch;
  joining_ = true;
  state_ = Phase::kForming;
  error_.clear();
  rpc::WorkerJoinGroup j = join;
  j.rendezvous = rendezvous;
  std::thread previous = std::move(join_);
  join_ = std::thread([this, j, s = *secret, l = std::move(listener), p = std::move(previous)]() mutable {
    JoinThread(j, std::move(s), std::move(l), std::move(p));
  });
  LOG(INFO) << "group " << o_.name << ": rank " << o_.rank << " of " << o_.world << " joining formation " << join.epoch
            << " at " << rendezvous;
  return rendezvous;
}

void GroupMember::JoinThread(rpc::WorkerJoinGroup join, std::string secret,
                             std::unique_ptr<CollectiveListener> listener, std::thread previous) {
  // A follower's previous formation ends first (its leader stopped it or
  // it broke).
  if (previous.joinable()) previous.join();
  CollectiveOptions co;
  co.rank = o_.rank;
  co.world = o_.world;
  co.rendezvous = join.rendezvous;
  co.timeout_s = o_.timeout_s;
  co.security.tls = o_.tls;
  co.security.insecure = o_.insecure;
  co.security.group_secret = std::move(secret);
  Result<std::unique_ptr<Collective>> joined = ConnectCollective(&rt_->backend(), co, std::move(listener));
  auto fail = [&](const Status& s) {
    LOG(WARNING) << "group " << o_.name << ": rank " << o_.rank << ", formation " << join.epoch << ": " << s;
    std::lock_guard<std::mutex> lk(mu_);
    joining_ = false;
    state_ = Phase::kBroken;
    error_ = s.ToString();
  };
  if (!joined.ok()) return fail(joined.status());
  Collective* c = joined->get();
  Status s = s_->RunOnLoop([&](Runtime& rt) -> Status {
    if (o_.rank == 0 && rt.context_group() != nullptr) (void)rt.StopGroup();  // the old formation's followers return
    PENUMBRA_RETURN_IF_ERROR(rt.SetContextGroup(c));
    return o_.rank == 0 ? rt.LeadGroup() : Status::OK();
  });
  if (!s.ok()) return fail(s);
  {
    std::lock_guard<std::mutex> lk(mu_);
    group_ = std::move(*joined);  // the old formation's group goes (the runtime let go of it)
    joining_ = false;
    state_ = Phase::kFormed;
    error_.clear();
  }
  LOG(INFO) << "group " << o_.name << ": rank " << o_.rank << " of " << o_.world << " formed (formation " << join.epoch
            << (o_.tls.enabled() ? ", mutual TLS" : ", plaintext") << ", group secret)";
  if (o_.rank == 0) return;
  // A follower runs rank 0's steps on its loop thread until rank 0 stops
  // the formation or it fails.
  Status followed = s_->RunOnLoop([](Runtime& rt) { return rt.FollowGroup(); });
  std::lock_guard<std::mutex> lk(mu_);
  if (epoch_ != join.epoch) return;  // a newer join took over
  state_ = followed.ok() ? Phase::kUnformed : Phase::kBroken;
  error_ = followed.ok() ? "rank 0 stopped formation " + std::to_string(join.epoch) : followed.ToString();
  LOG(WARNING) << "group " << o_.name << ": rank " << o_.rank << ": " << error_;
}

void GroupMember::WatchLoop() {
  const auto every = std::chrono::milliseconds(200);
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait_for(lk, every, [&] { return stop_; });
    if (stop_) return;
    if (state_ != Phase::kFormed) continue;
    const int64_t epoch = epoch_;
    lk.unlock();
    // The formation's first failure (a step's, or the runtime's heartbeat
    // to an idle group's followers).
    Status s = rt_->GroupHealth();
    lk.lock();
    if (!s.ok() && epoch_ == epoch && state_ == Phase::kFormed) {
      state_ = Phase::kBroken;
      error_ = s.ToString();
      LOG(WARNING) << "group " << o_.name << ": formation " << epoch << " broken: " << error_;
    }
  }
}

rpc::WorkerGroupState GroupMember::State() const {
  rpc::WorkerGroupState g;
  std::lock_guard<std::mutex> lk(mu_);
  g.name = o_.name;
  g.rank = o_.rank;
  g.world = o_.world;
  g.state = StateName(state_);
  g.epoch = epoch_;
  g.error = error_;
  return g;
}

Status GroupMember::Serving() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (o_.rank != 0) {
    return Status::Unavailable("rank " + std::to_string(o_.rank) + " of group " + o_.name +
                               " takes no requests (rank 0 does)");
  }
  if (state_ != Phase::kFormed) {
    return Status::Unavailable("group " + o_.name + " is " + StateName(state_) +
                               (error_.empty() ? std::string() : " (" + error_ + ")"));
  }
  return Status::OK();
}

void GroupMember::Stop() {
  bool lead = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_ && !join_.joinable() && !watch_.joinable()) return;
    stop_ = true;
    lead = o_.rank == 0 && state_ == Phase::kFormed;
    cv_.notify_all();
  }
  if (watch_.joinable()) watch_.join();
  if (lead) {
    Status s = s_->RunOnLoop([](Runtime& rt) { return rt.StopGroup(); });
    if (!s.ok()) LOG(WARNING) << "group " << o_.name << ": stopping the formation: " << s;
  }
  if (!join_.joinable()) return;
  if (o_.rank == 0) {
    join_.join();
  } else {
    // A follower's thread runs rank 0's steps until rank 0 stops them: the
    // process exits without waiting for it (it owns no request).
    join_.detach();
  }
}

}  // namespace penumbra::service
