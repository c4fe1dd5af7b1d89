// Per-op wall-clock breakdown of device work: Lap(op) synchronizes the
// backend and adds the time since the previous lap (or Start) to `op`, so the
// laps of one timeline sum to its wall time. Synchronizing after every op
// removes the overlap between ops and streams; the numbers say where time
// goes, not how fast the pipelined run is.
#pragma once
#include <chrono>
#include <map>
#include <string>

#include "worker/engine/backend.h"

namespace penumbra {

inline double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class OpProfiler {
 public:
  explicit OpProfiler(Backend* backend) : backend_(backend) {}
  void Start() {
    (void)backend_->Synchronize();
    t_ = NowSeconds();
  }
  void Lap(const std::string& op) {
    (void)backend_->Synchronize();
    const double now = NowSeconds();
    ms_[op] += (now - t_) * 1e3;
    t_ = now;
  }
  const std::map<std::string, double>& ms() const { return ms_; }
  void Clear() { ms_.clear(); }

 private:
  Backend* backend_;
  double t_ = 0;
  std::map<std::string, double> ms_;
};

}  // namespace penumbra
