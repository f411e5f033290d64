#pragma once

// A small filesystem for full-disk tests: a tmpfs mounted at a fresh
// directory, unmounted when the object goes (also when the test fails). The
// mount lives in a mount namespace of this process where it can have one, so
// it disappears with the process even if the process crashes; child
// processes (fsdprun, ranks) inherit it. Needs root: ok() says whether it
// could be mounted and why_not() why not (skip the test then).

#include <sched.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace fsdp::testing {

class SmallDisk {
 public:
  /// `size` as mount(8) takes it: "2m", "512k".
  explicit SmallDisk(const std::string& size) {
    char tmpl[] = "/tmp/fsdp_small_disk_XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) {
      why_not_ = std::string("mkdtemp: ") + std::strerror(errno);
      return;
    }
    path_ = tmpl;
    // A private namespace needs a single-threaded process; without one the
    // mount is global and only the destructor removes it.
    if (::unshare(CLONE_NEWNS) == 0) ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr);
    const std::string data = "size=" + size;
    if (::mount("tmpfs", path_.c_str(), "tmpfs", 0, data.c_str()) != 0) {
      why_not_ = std::string("cannot mount a tmpfs (needs root): ") + std::strerror(errno);
      return;
    }
    mounted_ = true;
  }
  ~SmallDisk() {
    if (mounted_) ::umount2(path_.c_str(), MNT_DETACH);
    if (!path_.empty()) ::rmdir(path_.c_str());
  }
  SmallDisk(const SmallDisk&) = delete;
  SmallDisk& operator=(const SmallDisk&) = delete;

  bool ok() const { return mounted_; }
  const std::string& why_not() const { return why_not_; }
  /// The mount point.
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string why_not_;
  bool mounted_ = false;
};

}  // namespace fsdp::testing
