// Note [Parameters backward reads without a gradient]: frozen parameters
// that backward reads after the unit's gradients arrived (LoRA's frozen
// base weight, a frozen layer ahead of trainable ones, a unit frozen whole
// between trainable ones) stay gathered until backward has passed the unit.
// Resharding at the reduction's launch, as units without frozen parameters
// do, freed them under those nodes: "setStorage ... out of bounds" on every
// rank. Parity against plain LibTorch on all ranks' batches, every step,
// with AdamW's weight decay (the frozen parameters must not move).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include <fsdp/fsdp.h>

#include "frozen_net.h"
#include "multi_rank.h"
#include "parity_ranks.h"

namespace fsdp::testing {
namespace test_frozen_reads {

using frozen_net::Loss;
using frozen_net::Made;
using frozen_net::train_and_compare;

TEST(FrozenReads, FrozenParametersReadLateTrainLikePlainLibTorch) {
  for (const int world : {1, 2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks_ok(world, [](int, int) {
      join_test_group();
      for (const Made made : {Made::kWrappers, Made::kCheckpointed, Made::kFullyShard}) {
        for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
          train_and_compare(made, strategy, Loss::kOneForward);
        }
      }
    });
  }
}

// Found by review: the inputs of the first forward were forgotten at the
// second, and a gradient penalty's backward resharded what the backward
// through its graph reads again.
TEST(FrozenReads, TwoForwardsAndAGradientPenaltyTrainLikePlainLibTorch) {
  run_ranks_ok(2, [](int, int) {
    join_test_group();
    for (const Made made : {Made::kWrappers, Made::kCheckpointed, Made::kFullyShard}) {
      for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
        for (const Loss how : {Loss::kTwoForwards, Loss::kGradientPenalty}) {
          train_and_compare(made, strategy, how);
        }
      }
    }
  });
}

}  // namespace test_frozen_reads
}  // namespace fsdp::testing
