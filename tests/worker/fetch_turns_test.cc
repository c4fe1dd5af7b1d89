// FetchTurns (worker/engine/fetch_turns.h): the host side of the lanes' turns
// on the host link. Two threads issue "fetches" layer by layer; the order in
// which they issue must follow (layer, lane), each Await must name the right
// predecessor, and lanes that are not stepping (or stall) must not hang others.
#include "worker/engine/fetch_turns.h"

#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <thread>
#include <vector>

namespace penumbra {
namespace {

// Distinct addresses standing in for the lanes' backends (never dereferenced).
Backend* Fake(int i) { return reinterpret_cast<Backend*>(static_cast<uintptr_t>(0x1000 * (i + 1))); }

TEST(FetchTurnsTest, AwaitBlocksUntilThePredecessorIssued) {
  FetchTurns turns;
  turns.AddLane(Fake(0));
  turns.AddLane(Fake(1));
  turns.StepBegin(0);
  turns.StepBegin(1);
  // Lane 1's fetch of layer 2 follows lane 0's fetch of layer 2.
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    const auto t = turns.Await(1, 2);
    ASSERT_TRUE(t.has_value());
    EXPECT_EQ(t->backend, Fake(0));
    EXPECT_EQ(t->layer, 2);
    returned = true;
  });
  turns.Issued(0, 0);
  turns.Issued(0, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(10));  // a window in which the waiter must not return
  EXPECT_FALSE(returned.load()) << "lane 1 went before lane 0 issued layer 2";
  turns.Issued(0, 2);
  waiter.join();
  EXPECT_TRUE(returned.load());
  // Lane 0's fetch of layer 3 follows lane 1's fetch of layer 2.
  returned = false;
  std::thread waiter0([&] {
    const auto t = turns.Await(0, 3);
    ASSERT_TRUE(t.has_value());
    EXPECT_EQ(t->backend, Fake(1));
    EXPECT_EQ(t->layer, 2);
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(10));  // a window in which the waiter must not return
  EXPECT_FALSE(returned.load());
  turns.Issued(1, 2);
  waiter0.join();
  EXPECT_TRUE(returned.load());
  // The first fetch of a step (lane 0, layer 0) waits for nobody.
  EXPECT_FALSE(turns.Await(0, 0).has_value());
  turns.StepEnd(0);
  turns.StepEnd(1);
  EXPECT_EQ(turns.timeouts(), 0);
}

TEST(FetchTurnsTest, ThreeLanesManyStepsNeverStallOrNameTheWrongTurn) {
  constexpr int kLanes = 3, kLayers = 32, kSteps = 30;
  FetchTurns turns;
  for (int i = 0; i < kLanes; ++i) ASSERT_EQ(turns.AddLane(Fake(i)), i);
  std::atomic<int> wrong{0}, waited{0};
  std::barrier sync(kLanes);  // the lanes start each step together (as in the benchmark)
  auto drive = [&](int lane) {
    for (int step = 0; step < kSteps; ++step) {
      sync.arrive_and_wait();
      DecodeStepScope scope(&turns, lane);
      for (int l = 0; l < kLayers; ++l) {
        if (const auto t = turns.Await(lane, l)) {
          ++waited;
          const int want_lane = lane > 0 ? lane - 1 : kLanes - 1;
          const int want_layer = lane > 0 ? l : l - 1;
          if (t->backend != Fake(want_lane) || t->layer != want_layer) ++wrong;
        }
        turns.Issued(lane, l);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int i = 1; i < kLanes; ++i) threads.emplace_back(drive, i);
  drive(0);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(waited.load(), 0);
  EXPECT_EQ(turns.timeouts(), 0);
}

TEST(FetchTurnsTest, LaneOutsideAStepIsNotWaitedFor) {
  FetchTurns turns;
  turns.AddLane(Fake(0));
  turns.AddLane(Fake(1));
  const auto t0 = std::chrono::steady_clock::now();
  DecodeStepScope scope(&turns, 0);
  for (int l = 0; l < 8; ++l) {
    EXPECT_FALSE(turns.Await(0, l).has_value());
    turns.Issued(0, l);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, FetchTurns::kMaxWait);
  EXPECT_EQ(turns.timeouts(), 0);
}

TEST(FetchTurnsTest, StalledLaneCostsOneBoundedWaitNotAHang) {
  FetchTurns turns;
  turns.AddLane(Fake(0));
  turns.AddLane(Fake(1));
  DecodeStepScope stalled(&turns, 0);  // in a step, never issues
  DecodeStepScope waiting(&turns, 1);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(turns.Await(1, 3).has_value());
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(waited, FetchTurns::kMaxWait);
  EXPECT_LT(waited, 20 * FetchTurns::kMaxWait);
  EXPECT_EQ(turns.timeouts(), 1);
}

TEST(FetchTurnsTest, RoundsPairLateJoinersAndDropLanesThatStop) {
  FetchTurns turns;
  turns.AddLane(Fake(0));
  turns.AddLane(Fake(1));
  // Lane 0 steps alone (lane 1 has never stepped: not waited for).
  for (int i = 0; i < 5; ++i) {
    DecodeStepScope scope(&turns, 0);
    EXPECT_FALSE(turns.Await(0, 3).has_value());
    turns.Issued(0, 3);
  }
  EXPECT_EQ(turns.timeouts(), 0);
  // Lane 1 joins: it pairs with lane 0's current round at once.
  turns.StepBegin(0);
  for (int l = 0; l < 4; ++l) turns.Issued(0, l);
  const auto t0 = std::chrono::steady_clock::now();
  turns.StepBegin(1);
  const auto t = turns.Await(1, 2);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, FetchTurns::kMaxWait);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->backend, Fake(0));
  EXPECT_EQ(t->layer, 2);
  turns.StepEnd(0);
  turns.StepEnd(1);
  EXPECT_EQ(turns.timeouts(), 0);
  // Lane 1 stops stepping: lane 0's next round waits for it once (bounded),
  // the rounds after that not at all.
  turns.StepBegin(0);
  turns.StepEnd(0);
  EXPECT_EQ(turns.timeouts(), 1);
  const auto t1 = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) {
    turns.StepBegin(0);
    turns.StepEnd(0);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t1, FetchTurns::kMaxWait);
  EXPECT_EQ(turns.timeouts(), 1);
}

TEST(FetchTurnsTest, OneLaneAndUnregisteredLanesNeverWait) {
  FetchTurns turns;
  turns.AddLane(Fake(0));
  DecodeStepScope scope(&turns, 0);
  EXPECT_FALSE(turns.Await(0, 5).has_value());
  // A lane being built (not yet registered) is ignored.
  turns.StepBegin(7);
  turns.Issued(7, 1);
  EXPECT_FALSE(turns.Await(7, 2).has_value());
  turns.StepEnd(7);
  EXPECT_EQ(turns.lanes(), 1);
  EXPECT_EQ(turns.timeouts(), 0);
}

}  // namespace
}  // namespace penumbra
