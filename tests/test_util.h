// Helpers shared by tests: paths to test data, element-by-element comparison,
// waiting for a condition (Eventually).
//
// Test data lives in the repository: tests/data/ (TestData), and files the
// build unpacks from compressed archives there (UnpackedTestData; see
// tests/CMakeLists.txt). Nothing is read from outside the checkout. A test
// whose data is missing fails with one line naming the path (DataExists),
// never crashes.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace penumbra::testing {

// The repository root (tests run from it; PENUMBRA_SOURCE_DIR overrides).
// Whether this build runs under ThreadSanitizer (ops/sanitize.sh tsan):
// tests whose cost is many repetitions of instrumented work (not the
// concurrency the sanitizer watches) run fewer of them there.
#if defined(__SANITIZE_THREAD__)
inline constexpr bool kUnderThreadSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool kUnderThreadSanitizer = true;
#else
inline constexpr bool kUnderThreadSanitizer = false;
#endif
#else
inline constexpr bool kUnderThreadSanitizer = false;
#endif
// The same for AddressSanitizer (ops/sanitize.sh asan).
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kUnderAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kUnderAddressSanitizer = true;
#else
inline constexpr bool kUnderAddressSanitizer = false;
#endif
#else
inline constexpr bool kUnderAddressSanitizer = false;
#endif
inline constexpr bool kUnderSanitizer = kUnderThreadSanitizer || kUnderAddressSanitizer;

inline std::string SourceDir() {
  const char* s = std::getenv("PENUMBRA_SOURCE_DIR");
  return s ? s : ".";
}

// A file or folder shipped under tests/data/.
inline std::string TestData(const std::string& relative) { return SourceDir() + "/tests/data/" + relative; }

// A file the build unpacks from an archive under tests/data/ into
// $PENUMBRA_TEST_DATA_DIR (CTest sets it; default build/test_data).
inline std::string UnpackedTestData(const std::string& relative) {
  const char* s = std::getenv("PENUMBRA_TEST_DATA_DIR");
  return (s ? std::string(s) : SourceDir() + "/build/test_data") + "/" + relative;
}

// Success when `path` exists; otherwise one line naming it. Use as
// ASSERT_TRUE(DataExists(p)) before reading test data.
inline ::testing::AssertionResult DataExists(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "test data missing: " << path
                                       << " (shipped under tests/data/, or unpacked there by the build)";
}

// The Hugging Face tokenizer.json of `name` (qwen2, llama2), unpacked from
// tests/data/tokenizer/<name>.tar.xz.
inline std::string TokenizerFile(const std::string& name) {
  return UnpackedTestData("tokenizers/" + name + "/tokenizer.json");
}

// The stories260K model (tests/data/models/stories260K/README.md).
inline std::string StoriesDir() { return TestData("models/stories260K"); }

// Fixture for tests that read test data: SetUp fails the test with one line
// per missing path returned by RequiredData(), and the body does not run.
class DataTest : public ::testing::Test {
 protected:
  virtual std::vector<std::string> RequiredData() const = 0;
  void SetUp() override {
    for (const std::string& p : RequiredData()) ASSERT_TRUE(DataExists(p));
  }
};

// Compares every element: |a - b| <= atol + rtol * |b|. Reports the first bad
// index and the count of bad elements. NaN never passes.
inline ::testing::AssertionResult AllClose(const float* actual, const float* expected, size_t n, float atol,
                                           float rtol) {
  size_t bad = 0, first = n;
  for (size_t i = 0; i < n; ++i) {
    const float a = actual[i], e = expected[i];
    const bool ok = std::isfinite(a) == std::isfinite(e) &&
                    (!std::isfinite(e) ? a == e : std::fabs(a - e) <= atol + rtol * std::fabs(e));
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
  if (a.size() != e.size()) return ::testing::AssertionFailure() << "size " << a.size() << " vs " << e.size();
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

// Waits for a condition instead of sleeping a fixed time: polls `condition`
// (a callable returning bool) with a backoff from 1 ms doubling up to 100 ms
// until it holds or `timeout` has passed (the condition is checked once more
// at the deadline). Success as soon as it holds; otherwise a failure naming
// `what` and the time waited. Use as
//   ASSERT_TRUE(Eventually([&] { return HealthOk(port); }, 10s, "the worker answers /health"));
template <typename Condition>
::testing::AssertionResult Eventually(Condition&& condition, std::chrono::milliseconds timeout,
                                      const std::string& what = "the condition") {
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  std::chrono::milliseconds pause(1);
  for (;;) {
    if (condition()) return ::testing::AssertionSuccess();
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
  if (condition()) return ::testing::AssertionSuccess();
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  return ::testing::AssertionFailure() << "timed out after " << waited.count() << " ms waiting for " << what;
}

}  // namespace penumbra::testing
