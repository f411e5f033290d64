#pragma once

#include <cstdint>
#include <string>

namespace fsdp::detail {

/// Bytes of host memory this process can still take without swapping or
/// meeting its container's limit: /proc/meminfo's MemAvailable, lowered to
/// the cgroup's limit minus its usage (v2 memory.max, or v1
/// memory.limit_in_bytes) where one is set. -1 where neither is readable.
int64_t host_available_bytes();

/// MemAvailable's bytes in the text of a /proc/meminfo, -1 without it.
int64_t mem_available_from_meminfo(const std::string& meminfo);

/// A cgroup's room, limit - usage, from the texts of its limit file ("max"
/// or a byte count) and usage file; -1 for no limit or unreadable texts.
int64_t cgroup_room(const std::string& limit, const std::string& usage);

}  // namespace fsdp::detail
