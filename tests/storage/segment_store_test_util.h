// Shared by the segment store tests: a temporary directory, and blobs whose
// bytes follow from (key, size) so any reader can check them.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include <glog/logging.h>

namespace penumbra::storage::testing {

class TempDir {
 public:
  TempDir() {
    std::string t = (std::filesystem::temp_directory_path() / "penumbra-store-XXXXXX").string();
    CHECK(mkdtemp(t.data()) != nullptr) << "mkdtemp " << t;
    path_ = t;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Two blobs ("k" of `bytes` bytes, "meta" naming the key and size) whose
// contents follow from (key, bytes).
inline std::map<std::string, std::string> BlobsFor(uint64_t key, size_t bytes) {
  std::string k(bytes, '\0');
  uint64_t x = key * 0x9E3779B97F4A7C15ull + bytes;
  for (size_t i = 0; i < bytes; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    k[i] = static_cast<char>(x);
  }
  return {{"k", std::move(k)}, {"meta", "key=" + std::to_string(key) + " bytes=" + std::to_string(bytes)}};
}

}  // namespace penumbra::storage::testing
