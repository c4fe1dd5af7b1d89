// Shared by the segment store tests: a temporary directory, and blobs whose
// bytes follow from (key, size) so any reader can check them.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
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

// XORs `count` bytes, evenly spaced, inside every file of `dir` whose name
// ends with `suffix` and that holds at least 256 bytes; returns how many
// files it changed.
// Flips (xor 0x5a) the byte at `at` of `path`.
inline void FlipByteAt(const std::filesystem::path& path, std::streamoff at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  char c = 0;
  f.seekg(at);
  f.read(&c, 1);
  c ^= 0x5a;
  f.seekp(at);
  f.write(&c, 1);
}

inline int FlipBytesInFiles(const std::string& dir, const std::string& suffix, int count) {
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.size() < suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const auto size = std::filesystem::file_size(e.path());
    if (size < 256) continue;
    for (int i = 1; i <= count; ++i) FlipByteAt(e.path(), static_cast<std::streamoff>(size * i / (count + 1)));
    ++files;
  }
  return files;
}

}  // namespace penumbra::storage::testing
