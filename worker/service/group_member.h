// GroupMember: a penumbra-worker's place in a context group inside the
// service (docs/architecture.md, "Worker groups"). A group is N worker
// processes (one per GPU) that hold one sequence sharded over them; each
// runs its own engine and serves the control API, but only rank 0 takes
// requests: its scheduler drives the group (Runtime::LeadGroup: every
// runtime step is first sent to the other ranks), and the others run the
// steps they are sent (Runtime::FollowGroup, on their scheduler's loop
// thread, the only thread that touches their runtime).
//
// The coordinator forms the group (JoinGroup on every rank: rank 0 first,
// which binds a port and answers where; then the others with that address)
// and gives each formation an epoch and a fresh secret every rank must
// prove it holds; with TLS files the group's connections are mutual TLS
// (role worker). A formation that loses a rank (a process gone, an exchange
// past the group's timeout) is "broken": rank 0's requests fail at their
// next step (the coordinator resumes them elsewhere) and the coordinator
// forms the group again once every rank answers. While formed and idle,
// rank 0's runtime sends the others a heartbeat (RuntimeOptions::
// group_heartbeat_ms), so a follower waiting for the next step does not take
// silence for a failure and a rank lost while idle is noticed; rank 0's
// member reads the runtime's GroupHealth a few times a second and reports
// the formation broken as soon as it fails.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/status.h"
#include "gen-cpp/worker_types.h"
#include "transport/tls.h"
#include "worker/engine/backend.h"
#include "worker/engine/collective.h"
#include "worker/parallel/process_group.h"
#include "worker/service/scheduler.h"

namespace penumbra::service {

struct GroupMemberOptions {
  std::string name;  // the group's name (--group); "" = not in a group
  int rank = 0;
  int world = 1;
  // Rank 0 listens for the other ranks on this address (port: one the OS
  // picks). Default: 127.0.0.1.
  std::string host = "127.0.0.1";
  // The group's exchanges (and its formation) fail when no byte moves for
  // this long. Default: 30 s.
  double timeout_s = 30;
  // Mutual TLS between the ranks (certificates of role worker); empty:
  // plaintext, loopback only unless insecure.
  transport::TlsFiles tls;
  bool insecure = false;
};

// The checks of a JoinGroup against this member's options, before any
// state: it names this member (name, rank, world), an epoch > 0, no
// rendezvous for rank 0 and rank 0's HOST:PORT for the others, and a secret
// of 32 to 1024 hex digits. Returns the secret's bytes; InvalidArgument
// naming the field otherwise (FailedPrecondition when not in a group).
Result<std::string> ValidateJoin(const GroupMemberOptions& o, const rpc::WorkerJoinGroup& join);

class GroupMember {
 public:
  // `scheduler` runs `runtime` (its loop thread); the group's data plane
  // is made for the runtime's backend. Both outlive this.
  GroupMember(Scheduler* scheduler, Runtime* runtime, GroupMemberOptions options);
  ~GroupMember();  // Stop()
  GroupMember(const GroupMember&) = delete;
  GroupMember& operator=(const GroupMember&) = delete;

  // The coordinator's JoinGroup: checks it names this member (name, world,
  // rank) and a newer epoch, then starts joining in the background and
  // returns the rendezvous (rank 0: the address it listens on; the others:
  // the one given). InvalidArgument for a join that is not this member's;
  // Unavailable while an earlier join is still under way or once stopped.
  Result<std::string> Join(const rpc::WorkerJoinGroup& join);
  // What Health reports.
  rpc::WorkerGroupState State() const;
  // OK when this worker takes requests: rank 0 of a formed group.
  // Unavailable naming why otherwise.
  Status Serving() const;
  // Rank 0 stops its formation (the others return from following); every
  // thread is joined. The runtime keeps its (stopped) group.
  void Stop();
  const GroupMemberOptions& options() const { return o_; }

 private:
  enum class Phase { kUnformed, kForming, kFormed, kBroken };
  static const char* StateName(Phase s);
  void JoinThread(rpc::WorkerJoinGroup join, std::string secret, std::unique_ptr<CollectiveListener> listener,
                  std::thread previous);
  void WatchLoop();  // rank 0

  Scheduler* s_;
  Runtime* rt_;
  GroupMemberOptions o_;
  mutable std::mutex mu_;
  std::condition_variable cv_;  // the watch loop's wait (stop_)
  Phase state_ = Phase::kUnformed;
  int64_t epoch_ = 0;
  std::string error_;
  bool joining_ = false, stop_ = false;
  // The formation in use (the runtime holds a pointer to it) and the one it
  // replaced (kept until the runtime let go of it).
  std::unique_ptr<Collective> group_;
  std::thread join_;   // the join under way (or the follower's steps)
  std::thread watch_;  // rank 0
};

}  // namespace penumbra::service
