// A small filesystem for full-disk tests: a tmpfs of `mib` MiB mounted on a
// fresh directory under the temporary directory (needs root, as CI runs;
// elsewhere ok() is false and why() says why, and the test skips). Fill()
// takes every free byte with a filler file (writes then fail with ENOSPC);
// Free() removes it. Unmounted (lazily, so a test that failed with files
// open still leaves nothing mounted) and removed when it goes.
#pragma once

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace penumbra::testing {

class SmallDisk {
 public:
  explicit SmallDisk(int mib) {
    std::string t = (std::filesystem::temp_directory_path() / "penumbra-small-disk-XXXXXX").string();
    if (mkdtemp(t.data()) == nullptr) {
      why_ = "mkdtemp: " + std::string(std::strerror(errno));
      return;
    }
    dir_ = t;
    const std::string opts = "size=" + std::to_string(mib) + "m";
    if (::mount("tmpfs", dir_.c_str(), "tmpfs", 0, opts.c_str()) != 0) {
      why_ = "cannot mount a " + std::to_string(mib) + " MiB tmpfs on " + dir_ + " (" + std::strerror(errno) +
             "; full-disk tests need root)";
      return;
    }
    mounted_ = true;
  }
  ~SmallDisk() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  SmallDisk(const SmallDisk&) = delete;
  SmallDisk& operator=(const SmallDisk&) = delete;

  bool ok() const { return mounted_; }
  const std::string& why() const { return why_; }
  const std::string& dir() const { return dir_; }

  // Writes a filler file until the filesystem has no free byte left.
  void Fill() {
    const std::string path = dir_ + "/filler-" + std::to_string(fillers_++);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return;  // not even an inode: full already
    std::vector<char> buf(size_t{1} << 20, 'f');
    for (size_t chunk : {size_t{1} << 20, size_t{4096}, size_t{1}}) {
      while (::write(fd, buf.data(), chunk) == static_cast<ssize_t>(chunk)) {
      }
    }
    ::close(fd);
  }
  // Removes the filler files.
  void Free() {
    for (int i = 0; i < fillers_; ++i) ::unlink((dir_ + "/filler-" + std::to_string(i)).c_str());
    fillers_ = 0;
  }
  uint64_t free_bytes() const {
    struct statvfs fs;
    return ::statvfs(dir_.c_str(), &fs) == 0 ? static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize : 0;
  }

 private:
  std::string dir_, why_;
  bool mounted_ = false;
  int fillers_ = 0;
};

}  // namespace penumbra::testing
