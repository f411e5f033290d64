// no_sync() gradient accumulation and clip_grad_norm_ against plain LibTorch.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>

#include <fsdp/fsdp.h>

#include "core/flat_parameter.h"
#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_training_tools {

TEST(TrainingTools, NoSyncOverFourMicroBatchesEqualsOneStep) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                          ShardingStrategy::kNoShard}) {
      torch::manual_seed(0);
      Net reference(false, FSDPOptions());
      torch::manual_seed(0);
      auto options = FSDPOptions().sharding_strategy(strategy);
      FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, options), options);
      torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
      // Each rank's 16 rows are its block of the global batch the reference trains on.
      torch::manual_seed(7);
      const int world = rank_and_world().second;
      torch::Tensor global_x = torch::randn({16 * world, 7});
      torch::Tensor global_target = torch::randn({16 * world, 3});
      torch::mse_loss(reference->forward(global_x), global_target).backward();
      ref_opt.step();
      torch::Tensor x = local_block(global_x), target = local_block(global_target);
      {
        auto guard = model->no_sync();
        for (int m = 0; m < 3; ++m) {
          (torch::mse_loss(model->forward(x.narrow(0, 4 * m, 4)), target.narrow(0, 4 * m, 4)) / 4)
              .backward();
        }
        for (const auto& shard : model->parameters()) {
          EXPECT_FALSE(shard.grad().defined()) << "no_sync communicated a gradient";
        }
      }
      (torch::mse_loss(model->forward(x.narrow(0, 12, 4)), target.narrow(0, 12, 4)) / 4).backward();
      opt.step();
      SummonFullParams full(*model.ptr());
      expect_same_params(*model.ptr(), *reference.ptr(), to_string(strategy));
    }
  });
}

// As PyTorch's FSDP (_should_free_in_backward): under no_sync() a unit that
// reshards after forward frees its parameters once backward has passed it,
// not at the end of backward (the whole model gathered at once);
// SHARD_GRAD_OP's stay gathered, as with gradients synced they do not.
// Guards nest as PyTorch's restore (an inner guard's end leaves the outer's
// accumulation alone); an inner unit's no_sync() is refused.
TEST(TrainingTools, NoSyncFreesEachUnitInBackwardAndGuardsNest) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    using State = FlatParameter::State;
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      const std::string what = to_string(strategy);
      torch::manual_seed(0);
      auto options = FSDPOptions().sharding_strategy(strategy);
      FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, options), options);
      const FlatParameter* block = unit_of(*model->module().block.ptr())->flat_param();
      // The block's state when backward reaches the model's input (fc1, the
      // last unit of backward, computed its input's gradient).
      const auto block_state_at_input = [&] {
        torch::Tensor x = torch::randn({4, 7}).requires_grad_(true);
        State seen = State::kSummoned;
        x.register_hook([&](const torch::Tensor&) { seen = block->state(); });
        model->forward(x).sum().backward();
        return seen;
      };
      {
        auto outer = model->no_sync();
        const State in_no_sync = block_state_at_input();
        EXPECT_EQ(in_no_sync,
                  strategy == ShardingStrategy::kFullShard ? State::kSharded : State::kUnsharded)
            << what;
        EXPECT_THROW(unit_of(*model->module().block.ptr())->no_sync(), c10::Error) << what;
        { auto inner = model->no_sync(); }
        block_state_at_input();
        for (const auto& shard : model->parameters()) {
          EXPECT_FALSE(shard.grad().defined()) << what << ": reduced inside the outer no_sync()";
        }
      }
      EXPECT_EQ(block_state_at_input(), State::kSharded) << what;
      for (const auto& shard : model->parameters()) EXPECT_TRUE(shard.grad().defined()) << what;
    }
  });
}

// FSDP2's set_requires_gradient_sync(false) accumulates as no_sync() does,
// until it is set true: three micro-batches a step, the last one synced,
// train as plain LibTorch on every rank's rows (SGD with momentum and weight
// decay), with a wrapper root and with fully_shard's; an inner unit's call is
// refused, and so is its setting alone at the first forward.
TEST(TrainingTools, SetRequiresGradientSyncAccumulatesUntilSetBack) {
  run_ranks_ok(2, [](int, int world) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      for (bool in_place : {false, true}) {
        const std::string what =
            std::string(to_string(strategy)) + (in_place ? " fully_shard" : " wrapper");
        torch::manual_seed(0);
        Net reference(false, FSDPOptions());
        torch::manual_seed(0);
        auto options = FSDPOptions().sharding_strategy(strategy);
        std::shared_ptr<torch::nn::Module> model;
        Unit* root = nullptr;
        Unit* inner = nullptr;  // the block's unit
        std::function<torch::Tensor(const torch::Tensor&)> forward;
        if (in_place) {
          auto net = std::make_shared<NetImpl>(false, options);
          inner = &fully_shard(*net->plain_block, options);
          root = &fully_shard(*net, options);
          forward = [net](const torch::Tensor& x) mutable { return net->forward(x); };
          model = net;
        } else {
          FullyShardedDataParallel<NetImpl> net(std::make_shared<NetImpl>(true, options), options);
          inner = unit_of(*net->module().block.ptr());
          root = net.ptr().get();
          forward = [net](const torch::Tensor& x) mutable { return net->forward(x); };
          model = net.ptr();
        }
        // Turned off on the block alone before the first forward (not known
        // to be inner yet): that forward refuses it, and nothing is lost.
        inner->set_requires_gradient_sync(false);
        EXPECT_THROW(forward(torch::randn({2, 7})), c10::Error) << what;
        inner->set_requires_gradient_sync(true);
        const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01);
        torch::optim::SGD ref_opt(reference->parameters(), sgd);
        torch::optim::SGD opt(root->flat_parameters(), sgd);
        for (int step = 0; step < 2; ++step) {
          torch::manual_seed(7 + step);
          const torch::Tensor global_x = torch::randn({12 * world, 7});
          const torch::Tensor global_target = torch::randn({12 * world, 3});
          ref_opt.zero_grad();
          torch::mse_loss(reference->forward(global_x), global_target).backward();
          ref_opt.step();
          const torch::Tensor x = local_block(global_x), target = local_block(global_target);
          opt.zero_grad();
          for (int m = 0; m < 3; ++m) {
            root->set_requires_gradient_sync(m == 2);
            (torch::mse_loss(forward(x.narrow(0, 4 * m, 4)), target.narrow(0, 4 * m, 4)) / 3)
                .backward();
            if (step == 0 && m < 2) {
              for (const auto& shard : root->flat_parameters()) {
                EXPECT_FALSE(shard.grad().defined()) << what << ": reduced with sync off";
              }
            }
          }
          opt.step();
          SummonFullParams full(*model);
          expect_same_params(*model, *reference.ptr(), what + " step " + std::to_string(step));
        }
        EXPECT_THROW(inner->set_requires_gradient_sync(false), c10::Error) << what;
      }
    }
  });
}

TEST(TrainingTools, ClipGradNormMatchesTheUnshardedNorm) {
  run_ranks_ok(3, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      for (double norm_type : {2.0, 1.0, std::numeric_limits<double>::infinity()}) {
        torch::manual_seed(0);
        Net reference(false, FSDPOptions());
        torch::manual_seed(0);
        auto options = FSDPOptions().sharding_strategy(strategy);
        FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, options), options);
        // Different rows per rank: a norm taken over one rank's shard or
        // one rank's gradient differs from the global one.
        torch::manual_seed(3);
        const int world = rank_and_world().second;
        torch::Tensor x = torch::randn({6 * world, 7}) * 10;
        torch::mse_loss(reference->forward(x), torch::zeros({6 * world, 3})).backward();
        torch::mse_loss(model->forward(local_block(x)), torch::zeros({6, 3})).backward();
        const double expected =
            torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.5, norm_type);
        const double actual = model->clip_grad_norm_(0.5, norm_type);
        EXPECT_NEAR(actual, expected, 1e-5 * std::max(1.0, expected))
            << to_string(strategy) << " p=" << norm_type;
        EXPECT_GT(expected, 0.5);  // so clipping really happened
        torch::optim::SGD(reference->parameters(), torch::optim::SGDOptions(1.0)).step();
        torch::optim::SGD(model->parameters(), torch::optim::SGDOptions(1.0)).step();
        SummonFullParams full(*model.ptr());
        expect_same_params(*model.ptr(), *reference.ptr(), "clipped step");
      }
    }
  });
}

// A NaN in one rank's gradient makes the norm NaN on every rank, for every
// norm type, and every gradient NaN, as torch's clip_grad_norm_ does (a
// review found the infinity norm finite: std::max dropped the NaN, so a
// loop that skips non-finite norms stepped on it).
TEST(TrainingTools, ClipGradNormIsNanOnEveryRankWhenOneGradientIs) {
  run_ranks_ok(2, [](int rank, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
      torch::manual_seed(0);
      FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, FSDPOptions()),
                                              FSDPOptions());
      torch::mse_loss(model->forward(torch::randn({4, 7})), torch::zeros({4, 3})).backward();
      if (rank == 1) {
        torch::NoGradGuard no_grad;
        model->parameters()[0].mutable_grad()[0] = std::nan("");
      }
      const double norm = model->clip_grad_norm_(0.5, norm_type);
      EXPECT_TRUE(std::isnan(norm)) << "p=" << norm_type << ": " << norm;
      for (const auto& shard : model->parameters()) {
        if (shard.grad().defined() && shard.grad().numel() > 0) {
          EXPECT_TRUE(shard.grad().isnan().all().item<bool>()) << "p=" << norm_type;
        }
      }
    }
  });
}

}  // namespace test_training_tools
}  // namespace fsdp::testing

namespace fsdp::testing {
namespace test_training_tools {

TEST(TrainingTools, SummonFullParamsWritebackAndRank0Only) {
  run_ranks_ok(2, [](int rank, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    torch::manual_seed(0);
    FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, FSDPOptions()),
                                            FSDPOptions());
    {
      SummonFullParams full(*model.ptr(), SummonOptions().writeback(true));
      torch::NoGradGuard no_grad;
      for (auto& p : model->named_parameters()) p.value().fill_(2.0);
    }
    {
      SummonFullParams full(*model.ptr());
      for (const auto& p : model->named_parameters()) {
        EXPECT_TRUE(torch::all(p.value() == 2.0).item<bool>()) << p.key() << " lost the writeback";
      }
    }
    {
      SummonFullParams full(*model.ptr(), SummonOptions().rank0_only(true));
      for (const auto& m : model->modules()) {
        auto* unit = dynamic_cast<Unit*>(m.get());
        if (unit == nullptr || unit->flat_param() == nullptr) continue;
        const auto expected =
            rank == 0 ? FlatParameter::State::kUnsharded : FlatParameter::State::kSharded;
        if (!unit->is_root()) EXPECT_EQ(unit->flat_param()->state(), expected);
      }
    }
    EXPECT_THROW(SummonFullParams(*model.ptr(), SummonOptions().writeback(true).rank0_only(true)),
                 c10::Error);
  });
}

// A guard inside a guard leaves the units as the outer one holds them, on
// every rank (FSDP's nested summon_full_params; Note [Nested summons]): under
// an outer rank0_only, an inner guard gathering on ranks 1.. only made the
// ranks' collectives diverge; an inner with_grads, or a state dict, freed
// what the outer one gathered. Forward through a held unit is refused on
// every rank (it would free the gathered parameters and the edits in them).
TEST(TrainingTools, NestedSummonsLeaveTheOuterGuardAsItIs) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    torch::manual_seed(0);
    FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, FSDPOptions()),
                                            FSDPOptions());
    const torch::Tensor x = torch::randn({4, 7});
    model->forward(x).sum().backward();
    const auto states = [&] {
      std::vector<FlatParameter::State> out;
      for (const auto& m : model->modules()) {
        const auto* unit = dynamic_cast<Unit*>(m.get());
        if (unit != nullptr && unit->flat_param() != nullptr) {
          out.push_back(unit->flat_param()->state());
        }
      }
      return out;
    };
    {
      SummonFullParams outer(*model.ptr(), SummonOptions().rank0_only(true));
      const auto held = states();
      { SummonFullParams inner(*model.ptr()); }
      { SummonFullParams inner(*model.ptr(), SummonOptions().with_grads(true)); }
      EXPECT_EQ(states(), held);
    }
    {
      SummonFullParams outer(*model.ptr(), SummonOptions().writeback(true));
      {
        torch::NoGradGuard no_grad;
        for (auto& p : model->named_parameters()) p.value().fill_(3.0);
      }
      { SummonFullParams inner(*model.ptr(), SummonOptions().with_grads(true)); }
      const auto full = full_state_dict(*model.ptr());
      for (const auto& p : model->named_parameters()) {
        EXPECT_TRUE(torch::all(p.value() == 3.0).item<bool>()) << p.key() << " was freed";
        EXPECT_TRUE(torch::equal(full[p.key()], p.value())) << p.key();
      }
      EXPECT_THROW(model->forward(x), c10::Error);
    }
    {
      SummonFullParams full(*model.ptr());
      for (const auto& p : model->named_parameters()) {
        EXPECT_TRUE(torch::all(p.value() == 3.0).item<bool>()) << p.key() << " lost the writeback";
      }
    }
    model->forward(x).sum().backward();  // trains on after the refused forward
  });
}

// A unit whose module has a parameter the forward never uses: its gradient
// is zero in the flat buffer and the rest still matches plain training.
struct PartlyUsedImpl : torch::nn::Module {
  PartlyUsedImpl() {
    used = register_module("used", torch::nn::Linear(5, 5));
    unused = register_module("unused", torch::nn::Linear(5, 5));
  }
  torch::Tensor forward(torch::Tensor x) { return used(x); }
  torch::nn::Linear used{nullptr}, unused{nullptr};
};
TORCH_MODULE(PartlyUsed);

TEST(TrainingTools, UnusedParametersMatchPlainTraining) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    torch::manual_seed(0);
    PartlyUsed reference;
    torch::manual_seed(0);
    FullyShardedDataParallel<PartlyUsedImpl> model(PartlyUsed{});
    expect_same_training(*reference.ptr(), *model.ptr(), {3, 5}, 3, 0.9, "partly used");
  });
}

}  // namespace test_training_tools
}  // namespace fsdp::testing

namespace fsdp::testing {
namespace test_training_tools {

// SummonOptions::with_grads (FSDP1's): inside the guard each parameter's
// .grad is its full gradient, the plain model's on the ranks' concatenated
// batches (different rows per rank), with flat shards and with
// use_orig_params, sharded or not; a parameter no rank's forward used has
// none under use_orig_params, as in plain LibTorch; with writeback a change
// to them is what the optimizer then steps; without it, nothing changes.
TEST(TrainingTools, SummonWithGradsShowsTheFullGradients) {
  run_ranks_ok(3, [](int, int world) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      for (bool orig : {false, true}) {
        const std::string what =
            std::string(to_string(strategy)) + (orig ? " use_orig_params" : "");
        auto [reference, model] =
            make_net_twins(FSDPOptions().sharding_strategy(strategy).use_orig_params(orig));
        torch::manual_seed(5);
        const torch::Tensor x = torch::randn({4 * world, 7}), y = torch::randn({4 * world, 3});
        torch::mse_loss(reference->forward(x), y).backward();
        torch::mse_loss(model->forward(local_block(x)), local_block(y)).backward();
        const auto want = reference->named_parameters();
        for (bool writeback : {false, true}) {
          SummonFullParams full(*model.ptr(),
                                SummonOptions().with_grads(true).writeback(writeback));
          for (const auto& p : model->named_parameters()) {
            const torch::Tensor& g = p.value().grad();
            ASSERT_TRUE(g.defined()) << what << " " << p.key();
            EXPECT_TRUE(torch::allclose(g, want[p.key()].grad(), 1e-5, 1e-6)) << what << p.key();
            torch::NoGradGuard no_grad;
            if (writeback) g.mul_(2);    // kept
            if (!writeback) g.fill_(7);  // dropped
          }
        }
        for (auto& p : reference->parameters()) p.mutable_grad().mul_(2);
        torch::optim::SGD(reference->parameters(), torch::optim::SGDOptions(1.0)).step();
        torch::optim::SGD(model->parameters(), torch::optim::SGDOptions(1.0)).step();
        SummonFullParams full(*model.ptr());
        expect_same_params(*model.ptr(), *reference.ptr(), what + " after writeback");
      }
    }
    // An unused parameter: no gradient with use_orig_params, as in plain
    // LibTorch (flat shards give it zeros, with the warning they give).
    torch::manual_seed(0);
    const auto options = FSDPOptions().use_orig_params(true);
    FullyShardedDataParallel<PartlyUsedImpl> partly(std::make_shared<PartlyUsedImpl>(), options);
    partly->forward(torch::randn({2, 5})).sum().backward();
    SummonFullParams full(*partly.ptr(), SummonOptions().with_grads(true));
    for (const auto& p : partly->named_parameters()) {
      EXPECT_EQ(p.value().grad().defined(), p.key().rfind("used.", 0) == 0) << p.key();
    }
  });
}

}  // namespace test_training_tools
}  // namespace fsdp::testing
