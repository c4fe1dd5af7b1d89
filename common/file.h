// Files: read-only memory maps and whole-file reads, with errors that name the
// path.
#pragma once

#include <cstddef>
#include <string>

#include "common/status.h"

namespace penumbra {

// A read-only memory map of a whole file. Move-only; unmaps on destruction.
class MappedFile {
 public:
  static Result<MappedFile> Open(const std::string& path);
  MappedFile() = default;
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

Result<std::string> ReadFileToString(const std::string& path);
bool FileExists(const std::string& path);
// Joins a directory and a file name with exactly one '/'.
std::string JoinPath(const std::string& dir, const std::string& name);

}  // namespace penumbra
