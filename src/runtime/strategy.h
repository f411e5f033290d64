#pragma once

// What each ShardingStrategy implies, asked in one place so that a new
// strategy is one switch here rather than comparisons spread over the runtime.

#include <fsdp/runtime/options.h>

namespace fsdp::detail {

/// True for kHybridShard and kHybridShardZero2: sharded within a node's
/// group, replicated across nodes (Note [Hybrid sharding]).
inline bool is_hybrid(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kHybridShard ||
         strategy == ShardingStrategy::kHybridShardZero2;
}

/// True where a non-root unit frees its gathered parameters after forward
/// and gathers them again for backward (FULL_SHARD and HYBRID_SHARD).
inline bool reshards_after_forward(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kFullShard || strategy == ShardingStrategy::kHybridShard;
}

/// True where the parameters are never sharded (NO_SHARD).
inline bool keeps_unsharded(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kNoShard;
}

}  // namespace fsdp::detail
