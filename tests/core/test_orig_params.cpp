// use_orig_params: the optimizer steps one view of the shard per original
// parameter, so parameter groups work (AdamW without weight decay on biases
// and LayerNorm), matching plain LibTorch with the same groups.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_orig_params {

// Two groups by name, as train_gpt does: decay on weight matrices only.
std::unique_ptr<torch::optim::AdamW> grouped_adamw(
    const torch::OrderedDict<std::string, torch::Tensor>& named) {
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : named) {
    const bool is_matrix = p.key().find("weight") != std::string::npos &&
                           p.key().find("block.2") == std::string::npos;  // block.2 is LayerNorm
    (is_matrix ? decay : no_decay).push_back(p.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(1e-2).weight_decay(0.5)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(1e-2).weight_decay(0.0)));
  return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(1e-2));
}

TEST(OrigParams, ParameterGroupsMatchPlainTraining) {
  for (int world : {1, 2, 3}) {
    run_ranks_ok(world, [](int, int) {
      init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
      for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
        torch::manual_seed(0);
        Net reference(false, FSDPOptions());
        torch::manual_seed(0);
        auto options = FSDPOptions().sharding_strategy(strategy).use_orig_params(true);
        FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, options), options);
        const auto named = model->named_flat_parameters();
        // Every original parameter is named, in order, with its original name.
        ASSERT_EQ(named.size(), reference->named_parameters().size());
        for (const auto& p : reference->named_parameters()) {
          EXPECT_NE(named.find(p.key()), nullptr) << "no optimizer parameter named " << p.key();
        }
        auto ref_opt = grouped_adamw(reference->named_parameters());
        auto opt = grouped_adamw(named);
        const int world = rank_and_world().second;
        for (int step = 0; step < 5; ++step) {
          // Different data per rank; the reference trains on all of it.
          torch::manual_seed(100 + step);
          torch::Tensor x = torch::randn({4 * world, 7});
          torch::Tensor target = torch::randn({4 * world, 3});
          ref_opt->zero_grad();
          torch::mse_loss(reference->forward(x), target).backward();
          ref_opt->step();
          opt->zero_grad();
          torch::mse_loss(model->forward(local_block(x)), local_block(target)).backward();
          opt->step();
          expect_same_after_step(*model.ptr(), *reference.ptr(), to_string(strategy), step);
        }
      }
    });
  }
}

}  // namespace test_orig_params
}  // namespace fsdp::testing
