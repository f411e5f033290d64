#include "memory/host_available.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

#include "memory/cpu_allocator.h"

namespace fsdp::detail {

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// A decimal count at the start of `text`, -1 if there is none.
int64_t leading_count(const std::string& text) {
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  return end == text.c_str() || value < 0 ? -1 : static_cast<int64_t>(value);
}

// `mount` + `path`, then each cgroup above it up to `mount` itself: a
// limit set on any of them bounds this process.
std::vector<std::string> dirs_up(const std::string& mount, std::string path) {
  std::vector<std::string> dirs;
  while (!path.empty() && path != "/") {
    dirs.push_back(mount + path);
    path.erase(path.find_last_of('/'));
  }
  dirs.push_back(mount);
  return dirs;
}

// The two cgroup versions' file names (Note [Host memory a cgroup leaves]).
struct CgroupKind {
  const char* mount;
  bool v2;
  const char* limit;
  const char* usage;
  const char* reclaimable;  // memory.stat's key of page cache the kernel takes back first
};

}  // namespace

// Note [Host memory a cgroup leaves]
// The room under a container's or a batch job's memory limit is its limit
// less what it uses, found in this process's own cgroup (/proc/self/cgroup:
// a SLURM job's or a systemd unit's, below the root of a host without a
// cgroup namespace) and every one above it. The usage counts page cache,
// which the kernel drops before it kills anything: a job that has just read
// a checkpoint would otherwise seem to have no room, so its inactive files
// are room too, as the kubelet reckons a container's working set.
int64_t mem_available_from_meminfo(const std::string& meminfo) {
  const std::string key = "MemAvailable:";
  const size_t at = meminfo.find(key);
  if (at == std::string::npos) return -1;
  const int64_t kib = leading_count(meminfo.substr(at + key.size()));
  return kib < 0 ? -1 : kib * 1024;
}

int64_t cgroup_room(const std::string& limit, const std::string& usage, int64_t reclaimable) {
  const int64_t cap = leading_count(limit);  // "max": no limit
  const int64_t used = leading_count(usage);
  // cgroup v1 writes a huge number (close to 2^63) for no limit.
  if (cap < 0 || used < 0 || cap >= (int64_t{1} << 60)) return -1;
  return std::max<int64_t>(0, cap - std::max<int64_t>(0, used - std::max<int64_t>(0, reclaimable)));
}

int64_t stat_count(const std::string& stat, const std::string& key) {
  std::istringstream lines(stat);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.size() > key.size() && line.compare(0, key.size(), key) == 0 &&
        line[key.size()] == ' ') {
      return leading_count(line.substr(key.size() + 1));
    }
  }
  return -1;
}

std::string cgroup_path(const std::string& proc_self_cgroup, bool v2) {
  std::istringstream lines(proc_self_cgroup);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t first = line.find(':');
    const size_t second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string controllers = "," + line.substr(first + 1, second - first - 1) + ",";
    const bool match = v2 ? line.compare(0, first, "0") == 0 && controllers == ",,"
                          : controllers.find(",memory,") != std::string::npos;
    if (match) return line.substr(second + 1);
  }
  return "";
}

int64_t host_room_bytes() {
  int64_t available = mem_available_from_meminfo(read_file("/proc/meminfo"));
  const std::string self = read_file("/proc/self/cgroup");
  for (const CgroupKind& kind :
       {CgroupKind{"/sys/fs/cgroup", true, "memory.max", "memory.current", "inactive_file"},
        CgroupKind{"/sys/fs/cgroup/memory", false, "memory.limit_in_bytes", "memory.usage_in_bytes",
                   "total_inactive_file"}}) {
    for (const std::string& dir : dirs_up(kind.mount, cgroup_path(self, kind.v2))) {
      const int64_t room =
          cgroup_room(read_file(dir + "/" + kind.limit), read_file(dir + "/" + kind.usage),
                      stat_count(read_file(dir + "/memory.stat"), kind.reclaimable));
      if (room >= 0) available = available < 0 ? room : std::min(available, room);
    }
  }
  return available;
}

int64_t host_available_bytes() {
  const int64_t room = host_room_bytes();
  // The block cache's free ranges are taken (resident, counted as used) but
  // serve the next allocations as they are.
  return room < 0 ? room : room + block_cache_stats().cached_bytes;
}

}  // namespace fsdp::detail
