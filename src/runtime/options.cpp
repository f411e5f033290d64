// FSDPOptions: what is derived from the options rather than stored.

#include <fsdp/runtime/options.h>

#include "detail/error.h"
#include "runtime/strategy.h"

namespace fsdp {

const char* to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard:
      return "NO_SHARD";
    case ShardingStrategy::kHybridShard:
      return "HYBRID_SHARD";
    case ShardingStrategy::kHybridShardZero2:
      return "_HYBRID_SHARD_ZERO2";
  }
  return "?";
}

FSDPOptions& FSDPOptions::reshard_after_forward(bool on) {
  // One state, the strategy: FSDP2's flag picks within its family.
  FSDP_CHECK(!detail::keeps_unsharded(sharding_strategy_), -1, "FSDPOptions",
             "reshard_after_forward(", on ? "true" : "false",
             ") does not apply to NO_SHARD, whose parameters are never sharded. Set "
             "sharding_strategy to kFullShard or kHybridShard first, or leave "
             "reshard_after_forward out");
  if (detail::is_hybrid(sharding_strategy_)) {
    sharding_strategy_ = on ? ShardingStrategy::kHybridShard : ShardingStrategy::kHybridShardZero2;
  } else {
    sharding_strategy_ = on ? ShardingStrategy::kFullShard : ShardingStrategy::kShardGradOp;
  }
  return *this;
}

bool FSDPOptions::reshard_after_forward() const {
  return detail::reshards_after_forward(sharding_strategy_);
}

}  // namespace fsdp
