// FetchTurns: the lanes of one engine take turns on the host link for their
// ShadowKV value fetches.
//
// Why: each lane's decode layer is compute (GEMMs, scoring, top-k) followed by
// a PCIe-bound value fetch. Left alone, two lanes drift into phase: both fetch
// at once (sharing the link, each at half speed), then both compute at once
// (the link idle). Measured on the H200 at 124928 x 14, natural hit rate: the
// link was idle 16% of the step and two fetches overlapped for 17.6 of its
// 51.5 ms (`penumbra-bench --fetch-timeline`).
//
// The turn order is (layer, lane): lane i's fetch of layer l follows lane
// i-1's fetch of layer l, and lane 0's follows the last lane's of layer l-1.
// Steps are paired into rounds: a lane beginning its r-th decode step waits
// (bounded) for the other lanes to begin theirs, so that lanes' layers are
// compared within the same round (without rounds, a lane starting its next
// step early would pair its layers with the other lane's previous step and run
// free). Before issuing a fetch, a lane's host thread waits until the lane
// before it in the order has *issued* its preceding fetch of the round, and
// the device then waits for that fetch to *finish* (an event, see
// Backend::WaitFetchDone). While one lane fetches, the others compute, so the
// link stays busy. The cost: lanes step together (a co-scheduled worker).
//
// Deadlock freedom: a lane only ever waits for a predecessor's fetch that is
// earlier in the order, a predecessor not in the same round is not waited
// for, and every host wait is bounded (kMaxWait, counted in timeouts()): a
// lane that stops stepping costs the others one bounded wait per step, never
// a hang. KvPolicy::EndDecodeStep ends a lane's step on every path. Sequence
// ids and batches stay per lane; only the order of fetches is coupled.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

namespace penumbra {

class Backend;

class FetchTurns {
 public:
  static constexpr std::chrono::milliseconds kMaxWait{50};

  // Registers a lane (its backend, for the device-side waits); returns its index.
  int AddLane(Backend* backend);
  int lanes() const;

  // A lane's decode step begins (waiting, bounded, for the other lanes that
  // have stepped before to begin the same round) / ends (on every path).
  void StepBegin(int lane);
  void StepEnd(int lane);

  struct Turn {
    Backend* backend = nullptr;  // the predecessor's backend
    int layer = 0;               // ... and the layer of the fetch to wait for
  };
  // Blocks (at most kMaxWait) until the fetch before (lane, layer) in the turn
  // order has been issued, and returns it; nullopt when there is nothing to
  // wait for (one lane, the first fetch of the order, a predecessor not in a
  // step, or the wait timed out).
  std::optional<Turn> Await(int lane, int layer);
  // The lane issued its fetch of `layer` (after recording its done event).
  void Issued(int lane, int layer);

  // How many Await calls timed out (diagnostics, tests).
  int timeouts() const;

 private:
  struct LaneState {
    Backend* backend = nullptr;
    bool in_step = false;
    int issued = -1;    // last layer whose fetch was issued in the current step
    int64_t round = 0;  // decode steps begun (paired across lanes, see StepBegin)
  };
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<LaneState> lanes_;
  int timeouts_ = 0;
};

// Calls StepBegin on construction and StepEnd on destruction (null: nothing).
class DecodeStepScope {
 public:
  DecodeStepScope(FetchTurns* turns, int lane) : turns_(turns), lane_(lane) {
    if (turns_) turns_->StepBegin(lane_);
  }
  ~DecodeStepScope() {
    if (turns_) turns_->StepEnd(lane_);
  }
  DecodeStepScope(const DecodeStepScope&) = delete;
  DecodeStepScope& operator=(const DecodeStepScope&) = delete;

 private:
  FetchTurns* turns_;
  int lane_;
};

}  // namespace penumbra
