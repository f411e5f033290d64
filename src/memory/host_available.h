#pragma once

#include <cstdint>
#include <string>

namespace fsdp::detail {

/// Bytes of host memory this process can still take without swapping or
/// meeting its container's limit: /proc/meminfo's MemAvailable, lowered to
/// the room under the limit of its cgroup or any above it (v2 memory.max, or
/// v1 memory.limit_in_bytes) where one is set, plus the CPU block cache's
/// free ranges. -1 where neither is readable (Note [Host memory a cgroup
/// leaves]).
int64_t host_available_bytes();

/// host_available_bytes() but for the block cache's free ranges: what the
/// kernel and the cgroups say.
int64_t host_room_bytes();

/// MemAvailable's bytes in the text of a /proc/meminfo, -1 without it.
int64_t mem_available_from_meminfo(const std::string& meminfo);

/// A cgroup's room, limit - (usage - reclaimable page cache), from the texts
/// of its limit file ("max" or a byte count) and usage file; -1 for no limit
/// or unreadable texts.
int64_t cgroup_room(const std::string& limit, const std::string& usage, int64_t reclaimable = 0);

/// The count after `key` on its line of a memory.stat text, -1 without it.
int64_t stat_count(const std::string& stat, const std::string& key);

/// This process's cgroup path in the text of /proc/self/cgroup: v2's unified
/// hierarchy ("0::PATH") or v1's memory controller; "" without it.
std::string cgroup_path(const std::string& proc_self_cgroup, bool v2);

}  // namespace fsdp::detail
