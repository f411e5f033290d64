// Parity on a small GPT (examples/models/gpt_mini.h: LayerNorm + causal self-attention
// + GELU MLP blocks, each block a unit, embeddings and head in the root, or
// the head a unit of its own): every strategy at world sizes 1, 2 and 3
// against plain LibTorch, 5 steps, each rank on its own sequences, compared
// every step.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include "gpt_mini.h"
#include "multi_rank.h"
#include "parity_ranks.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_transformer_parity {

gpt_mini::GPTConfig tiny() {
  return gpt_mini::GPTConfig().vocab_size(17).block_size(8).d_model(24).n_head(4).n_layer(3);
}

void compare(ShardingStrategy strategy, bool adam, bool head_unit = false) {
  torch::manual_seed(0);
  gpt_mini::GPT reference(tiny());
  torch::manual_seed(0);
  auto options = FSDPOptions().sharding_strategy(strategy);
  FullyShardedDataParallel<gpt_mini::GPTImpl> model(
      std::make_shared<gpt_mini::GPTImpl>(tiny().head_unit(head_unit), options), options);
  const auto children = model->named_children();
  const auto* head = children.find("head");
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(unit_of(**head) != nullptr, head_unit) << "the head is a unit of its own";
  auto make =
      [adam](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    if (adam) return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(3e-3));
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  };
  auto ref_opt = make(reference->parameters());
  auto opt = make(model->parameters());
  const int world = rank_and_world().second;
  for (int step = 0; step < 5; ++step) {
    // Different sequences per rank; the reference trains on all of them.
    torch::manual_seed(50 + step);
    torch::Tensor tokens = torch::randint(0, 17, {3 * world, 8});
    torch::Tensor targets = torch::randint(0, 17, {3 * world, 8});
    ref_opt->zero_grad();
    gpt_mini::lm_loss(reference->forward(tokens), targets).backward();
    ref_opt->step();
    opt->zero_grad();
    gpt_mini::lm_loss(model->forward(local_block(tokens)), local_block(targets)).backward();
    opt->step();
    expect_same_after_step(*model.ptr(), *reference.ptr(),
                           std::string(to_string(strategy)) + (adam ? " adam" : " sgd") +
                               (head_unit ? " head unit" : ""),
                           step);
  }
}

TEST(TransformerParity, SmallGptAllStrategies) {
  in_parity_ranks([] {
    for (const ShardingStrategy strategy : parity_strategies()) {
      compare(strategy, /*adam=*/true);
      compare(strategy, /*adam=*/false);
    }
  });
}

// The output head as a unit of its own (GPTConfig::head_unit): the same
// parameter names and results as plain LibTorch.
TEST(TransformerParity, HeadAsAUnitOfItsOwn) {
  in_parity_ranks([] {
    compare(ShardingStrategy::kFullShard, /*adam=*/true, /*head_unit=*/true);
    compare(ShardingStrategy::kNoShard, /*adam=*/false, /*head_unit=*/true);
  });
}

}  // namespace test_transformer_parity
}  // namespace fsdp::testing
