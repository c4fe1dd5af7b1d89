#include "worker/engine/fetch_turns.h"

#include <algorithm>

namespace penumbra {

int FetchTurns::AddLane(Backend* backend) {
  std::lock_guard<std::mutex> lock(mu_);
  lanes_.push_back(LaneState{backend, false, -1, 0});
  return static_cast<int>(lanes_.size()) - 1;
}

int FetchTurns::lanes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(lanes_.size());
}

// A lane index not (yet) registered is ignored: a lane joins the turns only
// once it is fully built (Engine::AddLane).
void FetchTurns::StepBegin(int lane) {
  std::unique_lock<std::mutex> lock(mu_);
  if (lane < 0 || lane >= static_cast<int>(lanes_.size())) return;
  LaneState& me = lanes_[lane];
  // Rounds pair the lanes' steps. A lane behind the others (it joined late or
  // sat idle) pairs with their current round; otherwise it opens the next.
  int64_t newest = 0;
  for (const LaneState& o : lanes_) newest = std::max(newest, o.round);
  me.in_step = true;
  me.issued = -1;
  me.round = std::max(me.round + 1, newest);
  const int64_t round = me.round;
  cv_.notify_all();
  // Wait (bounded) for the lanes one round behind to begin this round too;
  // lanes further behind have stopped stepping and are not waited for.
  auto all_here = [&] {
    for (const LaneState& o : lanes_)
      if (o.round == round - 1 && o.round > 0) return false;
    return true;
  };
  if (!cv_.wait_for(lock, kMaxWait, all_here)) ++timeouts_;
}

void FetchTurns::StepEnd(int lane) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (lane < 0 || lane >= static_cast<int>(lanes_.size())) return;
    lanes_[lane].in_step = false;
  }
  cv_.notify_all();
}

std::optional<FetchTurns::Turn> FetchTurns::Await(int lane, int layer) {
  std::unique_lock<std::mutex> lock(mu_);
  const int n = static_cast<int>(lanes_.size());
  if (n < 2 || lane < 0 || lane >= n) return std::nullopt;
  const int prev = lane > 0 ? lane - 1 : n - 1;
  const int prev_layer = lane > 0 ? layer : layer - 1;
  if (prev_layer < 0) return std::nullopt;  // the first fetch of the round
  const int64_t round = lanes_[lane].round;
  const LaneState& p = lanes_[prev];
  // Only a predecessor in the same round (its paired step) is waited for.
  auto same_round = [&] { return p.in_step && p.round == round; };
  if (!same_round()) return std::nullopt;
  auto ready = [&] { return !same_round() || p.issued >= prev_layer; };
  if (!cv_.wait_for(lock, kMaxWait, ready)) {
    ++timeouts_;
    return std::nullopt;
  }
  if (!same_round()) return std::nullopt;
  return Turn{p.backend, prev_layer};
}

void FetchTurns::Issued(int lane, int layer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (lane < 0 || lane >= static_cast<int>(lanes_.size())) return;
    lanes_[lane].issued = layer;
  }
  cv_.notify_all();
}

int FetchTurns::timeouts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timeouts_;
}

}  // namespace penumbra
