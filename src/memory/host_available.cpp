#include "memory/host_available.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace fsdp::detail {

namespace {

std::string read_file(const char* path) {
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

}  // namespace

int64_t mem_available_from_meminfo(const std::string& meminfo) {
  const std::string key = "MemAvailable:";
  const size_t at = meminfo.find(key);
  if (at == std::string::npos) return -1;
  const int64_t kib = leading_count(meminfo.substr(at + key.size()));
  return kib < 0 ? -1 : kib * 1024;
}

int64_t cgroup_room(const std::string& limit, const std::string& usage) {
  const int64_t cap = leading_count(limit);  // "max": no limit
  const int64_t used = leading_count(usage);
  // cgroup v1 writes a huge number (close to 2^63) for no limit.
  if (cap < 0 || used < 0 || cap >= (int64_t{1} << 60)) return -1;
  return std::max<int64_t>(0, cap - used);
}

int64_t host_available_bytes() {
  int64_t available = mem_available_from_meminfo(read_file("/proc/meminfo"));
  for (const auto& [limit, usage] :
       {std::pair{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
        std::pair{"/sys/fs/cgroup/memory/memory.limit_in_bytes",
                  "/sys/fs/cgroup/memory/memory.usage_in_bytes"}}) {
    const int64_t room = cgroup_room(read_file(limit), read_file(usage));
    if (room >= 0) available = available < 0 ? room : std::min(available, room);
  }
  return available;
}

}  // namespace fsdp::detail
