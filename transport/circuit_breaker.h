// CircuitBreaker: a remote peer's health as its callers see it (one per
// store node). Closed: calls go through. After `failures` consecutive calls
// that failed for the peer (it did not answer: Unavailable, DeadlineExceeded)
// it opens: calls fail at once, without waiting on the network, for
// `cool_down`; then it is half-open: one call (the probe) goes through, the
// others still fail at once; the probe's success closes it, its failure opens
// it again for another cool-down. An answer, even an error answer (NotFound,
// InvalidArgument...), is a success: the peer is alive.
//
// Time is passed in (tests drive it); thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace penumbra::transport {

struct CircuitBreakerOptions {
  int failures = 3;                           // consecutive failures that open the breaker (>= 1). Default: 3.
  std::chrono::milliseconds cool_down{5000};  // how long it stays open before a probe. Default: 5 s.
};

class CircuitBreaker {
 public:
  using Clock = std::chrono::steady_clock;
  enum class State { kClosed = 0, kOpen = 1, kHalfOpen = 2 };

  explicit CircuitBreaker(const CircuitBreakerOptions& o) : o_(o) {
    if (o_.failures < 1) o_.failures = 1;
  }

  // Whether a call may go now; false: fail it at once. A true while
  // half-open makes the caller the probe (it must report its outcome).
  bool Allow(Clock::time_point now) {
    std::lock_guard<std::mutex> l(mu_);
    if (state_ == State::kClosed) return true;
    if (state_ == State::kOpen && now >= open_until_) {
      state_ = State::kHalfOpen;
      probing_ = false;
    }
    if (state_ == State::kHalfOpen && !probing_) {
      probing_ = true;
      return true;
    }
    ++rejected_;
    return false;
  }
  // The outcome of a call Allow let through: `peer_failed` when the peer did
  // not answer.
  void Record(bool peer_failed, Clock::time_point now) {
    std::lock_guard<std::mutex> l(mu_);
    if (!peer_failed) {
      consecutive_ = 0;
      if (state_ != State::kClosed) ++closes_;
      state_ = State::kClosed;
      probing_ = false;
      return;
    }
    ++consecutive_;
    if (state_ == State::kHalfOpen || (state_ == State::kClosed && consecutive_ >= o_.failures)) {
      state_ = State::kOpen;
      probing_ = false;
      open_until_ = now + o_.cool_down;
      ++opens_;
    }
  }

  State state() const {
    std::lock_guard<std::mutex> l(mu_);
    return state_;
  }
  int consecutive_failures() const {
    std::lock_guard<std::mutex> l(mu_);
    return consecutive_;
  }
  // The time left open (0 when not open).
  std::chrono::milliseconds open_for(Clock::time_point now) const {
    std::lock_guard<std::mutex> l(mu_);
    if (state_ != State::kOpen || now >= open_until_) return std::chrono::milliseconds(0);
    return std::chrono::duration_cast<std::chrono::milliseconds>(open_until_ - now);
  }
  int64_t opens() const {  // times it opened
    std::lock_guard<std::mutex> l(mu_);
    return opens_;
  }
  int64_t closes() const {  // times it closed again (a probe succeeded)
    std::lock_guard<std::mutex> l(mu_);
    return closes_;
  }
  int64_t rejected() const {  // calls failed at once
    std::lock_guard<std::mutex> l(mu_);
    return rejected_;
  }
  const CircuitBreakerOptions& options() const { return o_; }

  static const char* StateName(State s) {
    switch (s) {
      case State::kClosed:
        return "closed";
      case State::kOpen:
        return "open";
      case State::kHalfOpen:
        return "half-open";
    }
    return "?";
  }

 private:
  CircuitBreakerOptions o_;
  mutable std::mutex mu_;
  State state_ = State::kClosed;
  bool probing_ = false;
  int consecutive_ = 0;
  Clock::time_point open_until_{};
  int64_t opens_ = 0, closes_ = 0, rejected_ = 0;
};

}  // namespace penumbra::transport
