// CircuitBreaker: the documented cycle (closed -> open after N consecutive
// failures -> half-open after the cool-down, one probe -> closed or open
// again), then random outcomes and clock steps against a small model.
#include "transport/circuit_breaker.h"

#include <random>

#include <gtest/gtest.h>

namespace penumbra::transport {
namespace {

using namespace std::chrono_literals;
using State = CircuitBreaker::State;

TEST(CircuitBreaker, OpensFailsFastProbesAndCloses) {
  CircuitBreaker b({/*failures=*/3, /*cool_down=*/1000ms});
  auto t = CircuitBreaker::Clock::time_point{} + 1h;
  // Failures that are not consecutive do not open it.
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(b.Allow(t));
    b.Record(/*peer_failed=*/i % 2 == 0, t);
  }
  EXPECT_EQ(b.state(), State::kClosed);
  b.Record(false, t);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(b.Allow(t));
    b.Record(true, t);
  }
  EXPECT_EQ(b.state(), State::kOpen);
  EXPECT_EQ(b.opens(), 1);
  EXPECT_FALSE(b.Allow(t + 999ms));  // fails at once during the cool-down
  EXPECT_EQ(b.rejected(), 1);
  EXPECT_EQ(b.open_for(t + 400ms), 600ms);
  // Half-open: one probe, the others still fail at once.
  EXPECT_TRUE(b.Allow(t + 1000ms));
  EXPECT_EQ(b.state(), State::kHalfOpen);
  EXPECT_FALSE(b.Allow(t + 1001ms));
  b.Record(true, t + 1500ms);  // the probe failed: open again, a new cool-down
  EXPECT_EQ(b.state(), State::kOpen);
  EXPECT_EQ(b.opens(), 2);
  EXPECT_FALSE(b.Allow(t + 2499ms));
  EXPECT_TRUE(b.Allow(t + 2500ms));
  b.Record(false, t + 2600ms);  // the probe succeeded
  EXPECT_EQ(b.state(), State::kClosed);
  EXPECT_EQ(b.closes(), 1);
  EXPECT_EQ(b.consecutive_failures(), 0);
  EXPECT_TRUE(b.Allow(t + 2600ms));
}

// Random calls (allowed or not, each outcome reported), random clock steps,
// against a model of the rules; compared after every step.
TEST(CircuitBreaker, MatchesAModelUnderRandomOutcomes) {
  for (int failures : {1, 2, 5}) {
    const auto cool = 300ms;
    CircuitBreaker b({failures, cool});
    struct Model {
      State state = State::kClosed;
      int consecutive = 0;
      bool probing = false;
      CircuitBreaker::Clock::time_point until{};
      int64_t opens = 0, rejected = 0;
    } m;
    std::mt19937 rng(static_cast<unsigned>(failures));
    auto now = CircuitBreaker::Clock::time_point{} + 1h;
    for (int step = 0; step < 20000; ++step) {
      now += std::chrono::milliseconds(rng() % 60);
      // The model's Allow.
      if (m.state == State::kOpen && now >= m.until) {
        m.state = State::kHalfOpen;
        m.probing = false;
      }
      bool allow = m.state == State::kClosed;
      if (m.state == State::kHalfOpen && !m.probing) {
        m.probing = true;
        allow = true;
      }
      if (!allow) ++m.rejected;
      ASSERT_EQ(b.Allow(now), allow) << "step " << step;
      if (allow) {
        const bool failed = rng() % 3 == 0;
        if (!failed) {
          m.state = State::kClosed;
          m.consecutive = 0;
          m.probing = false;
        } else {
          ++m.consecutive;
          if (m.state == State::kHalfOpen || (m.state == State::kClosed && m.consecutive >= failures)) {
            m.state = State::kOpen;
            m.probing = false;
            m.until = now + cool;
            ++m.opens;
          }
        }
        b.Record(failed, now);
      }
      ASSERT_EQ(b.state(), m.state) << "step " << step;
      ASSERT_EQ(b.consecutive_failures(), m.consecutive) << "step " << step;
      ASSERT_EQ(b.opens(), m.opens) << "step " << step;
      ASSERT_EQ(b.rejected(), m.rejected) << "step " << step;
    }
    EXPECT_GT(m.opens, 0);
  }
}

}  // namespace
}  // namespace penumbra::transport
