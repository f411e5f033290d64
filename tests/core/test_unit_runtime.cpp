// What a unit does between uses: FULL_SHARD keeps only shards outside a
// unit's forward and backward (measured with memory_stats), and each unit
// issues exactly the collectives FSDP needs (counted).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>

#include <fsdp/fsdp.h>

#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace {

using CountingGroup = CountingProcessGroup;

// A root without parameters around four big units, one counting group each.
struct WideImpl : torch::nn::Module {
  WideImpl(const std::vector<std::shared_ptr<CountingGroup>>& groups, ShardingStrategy strategy) {
    for (size_t i = 0; i < groups.size(); ++i) {
      auto o = FSDPOptions().sharding_strategy(strategy).process_group(groups[i]);
      units.push_back(register_module(
          "u" + std::to_string(i),
          FullyShardedDataParallel<torch::nn::LinearImpl>(torch::nn::Linear(512, 512), o)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& u : units) x = torch::relu(u->forward(x));
    return x;
  }
  std::vector<FullyShardedDataParallel<torch::nn::LinearImpl>> units;
};
TORCH_MODULE(Wide);

constexpr int64_t kUnitBytes = (512 * 512 + 512) * 4;

TEST(UnitRuntime, CollectivesPerUnitPerStep) {
  run_ranks_ok(2, [](int, int) {
    auto world = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                          ShardingStrategy::kNoShard}) {
      std::vector<std::shared_ptr<CountingGroup>> groups;
      for (int i = 0; i < 4; ++i) groups.push_back(std::make_shared<CountingGroup>(world));
      auto root_group = std::make_shared<CountingGroup>(world);
      auto o = FSDPOptions().sharding_strategy(strategy).process_group(root_group);
      FullyShardedDataParallel<WideImpl> model(Wide(groups, strategy), o);
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
      const int steps = 3;
      for (int s = 0; s < steps; ++s) {
        opt.zero_grad();
        model->forward(torch::randn({2, 512})).sum().backward();
        opt.step();
      }
      for (auto& g : groups) {
        if (strategy == ShardingStrategy::kNoShard) {
          EXPECT_EQ(g->all_gathers, 0) << to_string(strategy);
          EXPECT_EQ(g->all_reduces, steps) << to_string(strategy);
        } else {
          // FULL_SHARD gathers before forward and again before backward.
          const int gathers = strategy == ShardingStrategy::kFullShard ? 2 : 1;
          EXPECT_EQ(g->all_gathers, gathers * steps) << to_string(strategy);
          EXPECT_EQ(g->reduce_scatters, steps) << to_string(strategy);
        }
      }
      // A root without parameters communicates only the first iteration's
      // forward-order agreement: one tiny all-gather per unit and one at the
      // end of forward (Note [Forward order]).
      EXPECT_EQ(root_group->all_gathers, 4 + 1) << to_string(strategy);
      EXPECT_EQ(root_group->reduce_scatters + root_group->all_reduces, 0)
          << "a root without parameters communicates nothing else";
    }
  });
}

TEST(UnitRuntime, FullShardHoldsOnlyShardsAfterForward) {
  run_ranks_ok(2, [](int, int) {
    enable_memory_tracking();
    auto world = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      std::vector<std::shared_ptr<CountingGroup>> groups;
      for (int i = 0; i < 4; ++i) groups.push_back(std::make_shared<CountingGroup>(world));
      auto o = FSDPOptions().sharding_strategy(strategy);
      FullyShardedDataParallel<WideImpl> model(Wide(groups, strategy), o);
      torch::Tensor x = torch::randn({1, 512});
      const int64_t before = memory_stats().current_bytes;
      torch::Tensor loss = model->forward(x).sum();
      const int64_t grown = memory_stats().current_bytes - before;
      if (strategy == ShardingStrategy::kFullShard) {
        // Activations of batch 1 are a few KiB; one unsharded unit is 1 MiB.
        EXPECT_LT(grown, kUnitBytes / 2) << "FULL_SHARD kept unsharded parameters after forward";
      } else {
        EXPECT_GE(grown, 4 * kUnitBytes) << "SHARD_GRAD_OP should keep all four units gathered";
      }
      loss.backward();
      EXPECT_LT(memory_stats().current_bytes - before, 4 * kUnitBytes)
          << "units should be sharded again after backward";
    }
  });
}

TEST(UnitRuntime, WrappingTwiceIsAnError) {
  run_ranks_ok(1, [](int, int) {
    init_process_group();
    FullyShardedDataParallel<torch::nn::LinearImpl> unit(torch::nn::Linear(4, 4));
    try {
      AnyUnit again{torch::nn::AnyModule(unit)};
      ADD_FAILURE() << "a unit was wrapped again";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("already an FSDP unit"), std::string::npos) << e.what();
    }
  });
}

TEST(UnitRuntime, TrainAndEvalReachWrappedModules) {
  run_ranks_ok(1, [](int, int) {
    init_process_group();
    FullyShardedDataParallel<torch::nn::DropoutImpl> dropout(torch::nn::Dropout(0.5));
    dropout->eval();
    EXPECT_FALSE(dropout->module().is_training());
    torch::Tensor x = torch::ones({1000});
    EXPECT_TRUE(torch::equal(dropout->forward(x), x)) << "dropout still active in eval()";
    dropout->train();
    EXPECT_TRUE(dropout->module().is_training());
  });
}

}  // namespace
}  // namespace fsdp::testing
