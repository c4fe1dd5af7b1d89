// Helpers shared by tests: paths, GPU presence, element-by-element comparison.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace penumbra::testing {

// The repository root (tests run from it; PENUMBRA_SOURCE_DIR overrides).
inline std::string SourceDir() {
  const char* s = std::getenv("PENUMBRA_SOURCE_DIR");
  return s ? s : ".";
}
inline std::string SharedDir() { return SourceDir() + "/../shared"; }

// Compares every element: |a - b| <= atol + rtol * |b|. Reports the first bad
// index and the count of bad elements. NaN never passes.
inline ::testing::AssertionResult AllClose(const float* actual, const float* expected, size_t n, float atol,
                                           float rtol) {
  size_t bad = 0, first = n;
  for (size_t i = 0; i < n; ++i) {
    const float a = actual[i], e = expected[i];
    const bool ok = std::isfinite(a) == std::isfinite(e) && (!std::isfinite(e) ? a == e : std::fabs(a - e) <= atol + rtol * std::fabs(e));
    if (!ok || std::isnan(a)) {
      if (first == n) first = i;
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os << bad << " of " << n << " elements differ; first at index " << first << ": actual " << actual[first]
     << " expected " << expected[first] << " (atol " << atol << ", rtol " << rtol << ")";
  return ::testing::AssertionFailure() << os.str();
}
inline ::testing::AssertionResult AllClose(const std::vector<float>& a, const std::vector<float>& e, float atol,
                                           float rtol) {
  if (a.size() != e.size())
    return ::testing::AssertionFailure() << "size " << a.size() << " vs " << e.size();
  return AllClose(a.data(), e.data(), a.size(), atol, rtol);
}

// n floats uniform in [-1, 1) from std::mt19937(seed).
inline std::vector<float> RandomUniform(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

}  // namespace penumbra::testing
