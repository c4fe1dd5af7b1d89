// LockstepGroup: a context-parallel group whose ranks all live in one thread
// on one backend (the independent ShadowKV check's cp2 mode runs two ranks'
// policy objects side by side). Each rank is a Collective (rank(r)).
//
// The caller steps the ranks in lock step: for every collective call it
// makes that call for each rank in turn, and reads no rank's received data
// until every rank has made it. A rank's call records its buffers and
// returns; the call that completes the round (the last rank's) moves the
// data with the backend's device copies, on its main stream: ordered after
// the work issued before and before the work issued after, as Collective
// asks (synchronous on the CPU). Calls are matched by order, as every SPMD
// group's are: a round's calls must name the same operation, size (and
// root); a rank calling twice in one round, or a mismatch, is
// FailedPrecondition and breaks the group (every later call fails with it).
// The control-plane calls (BroadcastHost, AllGatherHost, Barrier) must be
// complete when they return, which one thread holding every rank cannot do:
// Unimplemented.
//
// Owns the ranks' Collective objects; needs the backend (outliving it).
// Not thread-safe: one thread makes every call.
#pragma once

#include <memory>
#include <vector>

#include "worker/engine/backend.h"
#include "worker/engine/collective.h"

namespace penumbra::shadowkv_check {

class LockstepGroup {
 public:
  // world >= 1 ranks on `backend`.
  LockstepGroup(Backend& backend, int world);
  ~LockstepGroup();
  LockstepGroup(const LockstepGroup&) = delete;
  LockstepGroup& operator=(const LockstepGroup&) = delete;

  int world() const { return static_cast<int>(ranks_.size()); }
  // Rank r's view (0 <= r < world()), valid while the group lives.
  Collective& rank(int r);

 private:
  class Rank;
  enum class Op { kNone, kAllGather, kBroadcast };
  struct Call {
    Op op = Op::kNone;
    const void* send = nullptr;
    void* recv = nullptr;
    size_t bytes = 0;
    int root = 0;
  };
  // Records rank r's call; the round's last one moves the data.
  Status Make(int r, const Call& c);
  Status Complete();

  Backend& backend_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::vector<Call> pending_;  // per rank: its call of the round under way (op kNone: not made yet)
  int made_ = 0;               // calls of the round under way
  Status broken_;              // the first failure: every later call returns it
};

}  // namespace penumbra::shadowkv_check
