#pragma once
// Resident-memory measurements for the memory tests that hold on any machine.
//
// Note [Measuring resident memory in tests]
// What a machine's kernel and the test binary's history must not change:
//  - Whether an allocator hands out memory that is already resident (reused)
//    or memory that touching faults in: the growth of the RSS while a block
//    is allocated and touched (malloc may write past the block, e.g. glibc's
//    next chunk header), in bytes. Not page faults per page: a kernel with
//    transparent huge pages (or mTHP) maps up to 512 pages per fault, and
//    glibc's first blocks (fresh mmaps) and later ones (its heap) get huge
//    pages differently, so fault counts measure the kernel's configuration.
//    (Nor mincore() at hand-out: a huge page faulted in for one block covers
//    the start of the next.)
//  - Peak RSS is VmHWM after resetting it (/proc/self/clear_refs) at the
//    baseline, not getrusage's ru_maxrss: after exec() that starts from the
//    RSS of the process that forked, i.e. whatever the test binary's earlier
//    tests left resident.

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

namespace fsdp::testing {

/// The process's resident bytes now (VmRSS); -1 where it cannot be read.
inline int64_t rss_now() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = -1;
  statm >> pages >> resident;
  return resident < 0 ? -1 : static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE);
}

/// Resets the resident high-water mark (VmHWM) to the RSS now; false where
/// the kernel does not let the process (Linux < 4.0, some sandboxes).
inline bool reset_peak_rss() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5" << std::flush;
  return clear_refs.good();
}

/// VmHWM in bytes (see reset_peak_rss()); -1 where it cannot be read.
inline int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

}  // namespace fsdp::testing
