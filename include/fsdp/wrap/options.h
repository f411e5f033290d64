#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <memory>

#include <fsdp/comm/process_group.h>

namespace fsdp {

/// How a unit's parameters are sharded between uses (PyTorch's names).
enum class ShardingStrategy : uint8_t {
  /// Parameters, gradients and optimizer state sharded; parameters are
  /// gathered before forward, freed after it, gathered again for backward.
  kFullShard,
  /// Like kFullShard, but parameters stay gathered from forward through backward.
  kShardGradOp,
  /// Nothing sharded; gradients are all-reduced (data parallelism, DDP).
  kNoShard,
};

/// Which all-gather is issued early during backward (PyTorch's names).
enum class BackwardPrefetch : uint8_t {
  /// Gather each unit only when its own backward starts.
  kNone,
  /// When a unit's backward starts, also start gathering the unit whose
  /// backward comes next (more overlap, one more unit's memory).
  kBackwardPre,
  /// Start gathering the next unit once this unit's gradients are reduced.
  kBackwardPost,
};

/// The name of a strategy, for messages.
const char* to_string(ShardingStrategy strategy);

/// Options of an FSDP unit, in LibTorch's style:
/// `fsdp::FSDPOptions().sharding_strategy(fsdp::ShardingStrategy::kShardGradOp)`.
struct FSDPOptions {
  /// The group to shard over; nullptr: fsdp::default_process_group().
  TORCH_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
  /// See ShardingStrategy.
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kFullShard;
  /// Issue the next unit's all-gather (in the first iteration's forward
  /// order) before this unit computes, so communication overlaps compute.
  TORCH_ARG(bool, forward_prefetch) = false;
  /// See BackwardPrefetch; it matters for kFullShard only.
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::kBackwardPre;
  /// The optimizer steps one view of the shard per original parameter
  /// (possibly empty on ranks that hold none of it) instead of one flat
  /// shard, so parameter groups (e.g. no weight decay on biases) work.
  TORCH_ARG(bool, use_orig_params) = false;
  /// Check the forward order of units (the root's option counts): in the
  /// first training iteration ranks agree on each unit before gathering it
  /// (an error on every rank when they differ); later iterations warn once
  /// when a rank's order changes. See Note [Forward order].
  TORCH_ARG(bool, check_forward_order) = true;
};

}  // namespace fsdp
