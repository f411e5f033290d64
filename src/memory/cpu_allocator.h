#pragma once

#include "memory/block_cache.h"

namespace fsdp::detail {

/// The CPU block cache's counts (Note [CPU block cache]).
BlockCache::Stats block_cache_stats();

/// fsdp::enable_cpu_block_cache() unless FSDP_CPU_BLOCK_CACHE=0 (read once):
/// what FSDP units do when they are constructed. Defined in cpu_allocator.cpp.
void enable_cpu_block_cache_by_default();

}  // namespace fsdp::detail
