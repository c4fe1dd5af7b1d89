#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "kernels/cpu/ops.h"

namespace penumbra::kernels::cpu {

void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn, int threads) {
  if (n <= 0) return;
  int t = threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  t = static_cast<int>(std::min<int64_t>(t, n));
  if (t == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(t - 1);
  for (int i = 1; i < t; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

}  // namespace penumbra::kernels::cpu
