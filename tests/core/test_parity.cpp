// Parity: a model wrapped with FSDP trains to the same parameters as the same
// model trained by plain LibTorch on the same data, parameter by parameter,
// for every sharding strategy, at world sizes 1, 2 and 3 (uneven padding),
// with SGD (momentum) and Adam. Each rank trains on its own block of a global
// batch, the reference on the whole batch (mean loss), compared every step.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <string>

#include <fsdp/fsdp.h>

#include "core/flat_parameter.h"
#include "multi_rank.h"
#include "parity_ranks.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_parity {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                        std::vector<torch::Tensor> params) {
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
}

// The global batch of a step (the same on every rank; each rank trains on its
// block, see local_block).
torch::Tensor global_batch(int step, int64_t rows) {
  torch::manual_seed(1000 + step);
  return torch::randn({rows, 7});
}

void train_and_compare(const FSDPOptions& options, const std::string& optimizer, int steps) {
  const ShardingStrategy strategy = options.sharding_strategy();
  const int world = rank_and_world().second;
  torch::manual_seed(0);
  Net reference(false, FSDPOptions());
  torch::manual_seed(0);
  FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, options), options);
  auto ref_opt = make_optimizer(optimizer, reference->parameters());
  auto opt = make_optimizer(optimizer, model->parameters());
  for (int step = 0; step < steps; ++step) {
    torch::Tensor x = global_batch(step, 5 * world);
    torch::Tensor target = torch::randn({5 * world, 3});
    ref_opt->zero_grad();
    torch::mse_loss(reference->forward(x), target).backward();
    ref_opt->step();
    opt->zero_grad();
    torch::Tensor loss = torch::mse_loss(model->forward(local_block(x)), local_block(target));
    loss.backward();
    opt->step();
    expect_same_after_step(*model.ptr(), *reference.ptr(),
                           std::string(to_string(strategy)) + " " + optimizer, step);
  }
}

TEST(Parity, StrategiesWorldSizesOptimizers) {
  in_parity_ranks([] {
    for (const ShardingStrategy strategy : parity_strategies()) {
      for (const char* optimizer : {"sgd", "adam"}) {
        train_and_compare(FSDPOptions().sharding_strategy(strategy), optimizer, 5);
      }
    }
    // Prefetching changes when parameters are gathered, never the result.
    for (auto backward : {BackwardPrefetch::kNone, BackwardPrefetch::kBackwardPost}) {
      train_and_compare(FSDPOptions().forward_prefetch(true).backward_prefetch(backward), "adam",
                        5);
    }
  });
}

// Unit::set_gradient_divide_factor (Note [A gradient divide factor]): the
// reduced gradient is the ranks' sum divided by the factor, which plain
// LibTorch computes from its mean loss scaled by world / factor: 1 sums the
// ranks' gradients, 0.5 doubles that. Every strategy, every step, SGD with
// momentum (Adam would hide a scale). A factor that is not a positive
// finite number is refused naming it.
TEST(Parity, AGradientDivideFactorSumsTheRanksGradients) {
  in_parity_ranks([] {
    const int world = rank_and_world().second;
    for (const ShardingStrategy strategy : parity_strategies()) {
      for (const double factor : {1.0, 0.5}) {
        const std::string what =
            std::string(to_string(strategy)) + " divided by " + std::to_string(factor);
        const auto options = FSDPOptions().sharding_strategy(strategy);
        torch::manual_seed(0);
        Net reference(false, FSDPOptions());
        torch::manual_seed(0);
        FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, options), options);
        model->set_gradient_divide_factor(factor, /*recurse=*/true);
        auto ref_opt = make_optimizer("sgd", reference->parameters());
        auto opt = make_optimizer("sgd", model->parameters());
        for (int step = 0; step < 3; ++step) {
          torch::Tensor x = global_batch(step, 5 * world);
          torch::Tensor target = torch::randn({5 * world, 3});
          ref_opt->zero_grad();
          (torch::mse_loss(reference->forward(x), target) * (world / factor)).backward();
          ref_opt->step();
          opt->zero_grad();
          torch::mse_loss(model->forward(local_block(x)), local_block(target)).backward();
          opt->step();
          expect_same_after_step(*model.ptr(), *reference.ptr(), what, step);
        }
        for (const double bad : {0.0, -2.0, std::nan(""), HUGE_VAL}) {
          try {
            model->set_gradient_divide_factor(bad);
            ADD_FAILURE() << "factor " << bad << " accepted";
          } catch (const c10::Error& e) {
            EXPECT_NE(std::string(e.what_without_backtrace()).find("expected a positive, finite"),
                      std::string::npos)
                << e.what_without_backtrace();
          }
        }
      }
    }
  });
}

TEST(Parity, FullShardHoldsOnlyShardsBetweenUses) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    torch::manual_seed(0);
    auto options = FSDPOptions().sharding_strategy(ShardingStrategy::kFullShard);
    FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, options), options);
    const std::vector<Unit*> units = units_of(*model.ptr());
    ASSERT_EQ(units.size(), 3u);  // root, block, fc1 (registration order; forward runs fc1 first)
    for (Unit* u : units) EXPECT_EQ(u->flat_param()->state(), FlatParameter::State::kSharded);
    torch::Tensor loss = model->forward(global_batch(0, 4)).sum();
    EXPECT_EQ(units[0]->flat_param()->state(), FlatParameter::State::kUnsharded);  // the root
    // block, whose forward ended last, is kept for its backward, which comes
    // first (Note [The first unit of backward stays gathered]); fc1 holds
    // only its shard.
    EXPECT_EQ(units[1]->flat_param()->state(), FlatParameter::State::kUnsharded);
    EXPECT_EQ(units[2]->flat_param()->state(), FlatParameter::State::kSharded);
    loss.backward();
    for (Unit* u : units) {
      EXPECT_EQ(u->flat_param()->state(), FlatParameter::State::kSharded);
      ASSERT_TRUE(u->flat_param()->shard().grad().defined());
      EXPECT_EQ(u->flat_param()->shard().grad().numel(), u->flat_param()->padded_numel() / 2);
    }
  });
}

}  // namespace test_parity
}  // namespace fsdp::testing
