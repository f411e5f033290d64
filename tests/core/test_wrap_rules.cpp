// Auto-wrap rules from PyTorch's _wrap_utils.py (seed 003): a tree that
// already holds units is refused naming the first; a unit's parameters must
// be uniformly frozen or trainable (error without use_orig_params, warning
// with it, both listing the names on each side); ignored_modules stay
// unmanaged; under mixed precision the BatchNorm family is wrapped
// separately in full precision, with a warning.

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "core/flat_parameter.h"
#include "detail/torch_compat.h"
#include "error_of.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace test_wrap_rules {

namespace nn = torch::nn;

using compat::WarningCollector;

// A Sequential with a concrete forward, so it can be an entry of another.
struct BlockImpl : nn::SequentialImpl {
  using nn::SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return nn::SequentialImpl::forward(x); }
};
TORCH_MODULE(Block);

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::shared_ptr<ProcessGroup> start_rank() {
  torch::set_num_threads(1);
  return init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
}

// FSDP2's reshard_after_forward is the choice within a strategy's family,
// kept as the strategy alone (no second flag to disagree with it).
TEST(WrapRules, ReshardAfterForwardPicksTheStrategyOfItsFamily) {
  FSDPOptions o;
  EXPECT_TRUE(o.reshard_after_forward());
  EXPECT_EQ(o.reshard_after_forward(false).sharding_strategy(), ShardingStrategy::kShardGradOp);
  EXPECT_FALSE(o.reshard_after_forward());
  EXPECT_EQ(o.reshard_after_forward(true).sharding_strategy(), ShardingStrategy::kFullShard);
  o.sharding_strategy(ShardingStrategy::kHybridShard).reshard_after_forward(false);
  EXPECT_EQ(o.sharding_strategy(), ShardingStrategy::kHybridShardZero2);
  EXPECT_EQ(o.reshard_after_forward(true).sharding_strategy(), ShardingStrategy::kHybridShard);
  o.sharding_strategy(ShardingStrategy::kNoShard);
  EXPECT_FALSE(o.reshard_after_forward());
  EXPECT_NE(error_of([&] {
              o.reshard_after_forward(false);
            }).find("reshard_after_forward(false) does not apply to NO_SHARD"),
            std::string::npos);
  EXPECT_EQ(o.sharding_strategy(), ShardingStrategy::kNoShard);
}

TEST(WrapRules, TreeWithUnitsIsRefusedNamingTheFirst) {
  run_ranks_ok(2, [](int rank, int) {
    const auto group = start_rank();
    Block block(nn::Linear(4, 4), nn::Linear(4, 4));
    nn::Sequential seq(nn::Linear(4, 4), block, nn::Linear(4, 4));
    nn::Sequential inner(std::static_pointer_cast<nn::SequentialImpl>(block.ptr()));
    wrap_sequential_entry(inner, 1);
    wrap_sequential_entry(seq, 2);
    const std::string msg = error_of([&] { auto_wrap(seq, AlwaysWrapPolicy()); });
    EXPECT_TRUE(contains(msg, "[rank " + std::to_string(rank) +
                                  "] fsdp(1.1): expected a module tree without FSDP units"))
        << msg;
    group->barrier().wait();
  });
}

TEST(WrapRules, MixedFrozenUnitIsAnErrorOrAWarning) {
  run_ranks_ok(2, [](int, int) {
    const auto group = start_rank();
    auto make = [] {
      nn::Sequential seq(nn::Linear(4, 4), nn::ReLU(), nn::Linear(4, 2));
      seq->ptr(0)->as<nn::Linear>()->weight.set_requires_grad(false);  // bias stays trainable
      return seq;
    };
    const auto policy = module_type_policy<nn::LinearImpl>();

    // use_orig_params(false): an error naming both sides; nothing wrapped.
    nn::Sequential seq = make();
    std::string msg = error_of([&] { auto_wrap(seq, policy, FSDPOptions()); });
    EXPECT_TRUE(contains(msg,
                         "fsdp(0): 0 has both parameters with requires_grad=true and "
                         "requires_grad=false"))
        << msg;
    EXPECT_TRUE(contains(msg, "does not support wrapping such modules when use_orig_params=false"))
        << msg;
    EXPECT_TRUE(contains(msg, "wrap the frozen parameters with FSDP separately")) << msg;
    EXPECT_TRUE(contains(msg, "requires_grad=true:\n[0.bias]")) << msg;
    EXPECT_TRUE(contains(msg, "requires_grad=false:\n[0.weight]")) << msg;
    EXPECT_NE(dynamic_cast<nn::LinearImpl*>(seq->ptr(0).get()), nullptr) << "nothing wrapped";

    // use_orig_params(true): a warning with the gradient numel, and the units.
    std::vector<std::string> warnings;
    {
      WarningCollector guard(&warnings);
      nn::Sequential seq2 = make();
      auto units = auto_wrap(seq2, policy, FSDPOptions().use_orig_params(true));
      EXPECT_EQ(units.size(), 2u);
    }
    ASSERT_EQ(warnings.size(), 1u);
    msg = warnings[0];
    EXPECT_TRUE(contains(msg, "fsdp(0): 0 has both parameters")) << msg;
    EXPECT_TRUE(contains(msg, "(20 numel instead of 4 numel before sharding")) << msg;
    EXPECT_TRUE(contains(msg, "wrap the frozen parameters with FSDP separately")) << msg;
    EXPECT_TRUE(contains(msg, "requires_grad=true:\n[0.bias]")) << msg;
    EXPECT_TRUE(contains(msg, "requires_grad=false:\n[0.weight]")) << msg;

    // Frozen and trainable parameters in separate units: no complaint.
    warnings.clear();
    {
      WarningCollector guard(&warnings);
      nn::Sequential seq3(nn::Linear(4, 4), nn::Linear(4, 2));
      for (auto& p : seq3->ptr(0)->parameters()) p.set_requires_grad(false);
      auto_wrap(seq3, policy, FSDPOptions());
    }
    EXPECT_TRUE(warnings.empty());
    group->barrier().wait();
  });
}

// A model whose root registers the ignored embedding's weight again (tied).
struct TiedImpl : nn::Module {
  TiedImpl() {
    wte = register_module("wte", nn::Linear(4, 4));
    fc = register_module("fc", nn::Linear(4, 2));
    head_weight = register_parameter("head_weight", wte->weight);
  }
  torch::Tensor forward(torch::Tensor x) {
    return fc(wte(x)).sum() + x.matmul(head_weight.t()).sum();
  }
  nn::Linear wte{nullptr}, fc{nullptr};
  torch::Tensor head_weight;
};

// PyTorch ignores parameters, not places (_get_ignored_params): an ignored
// module's parameter registered elsewhere too stays out of every unit, full
// on each rank, where it was flattened, sharded and averaged over the ranks.
TEST(WrapRules, AnIgnoredModulesTiedParameterStaysUnmanaged) {
  run_ranks_ok(2, [](int rank, int) {
    const auto group = start_rank();
    torch::manual_seed(0);
    auto plain = std::make_shared<TiedImpl>();
    torch::manual_seed(0);
    auto tied = std::make_shared<TiedImpl>();
    FullyShardedDataParallel<TiedImpl> root(
        tied,
        FSDPOptions().ignored_modules(std::vector<std::shared_ptr<nn::Module>>{tied->wte.ptr()}));
    ASSERT_NE(root->flat_param(), nullptr);
    std::vector<std::string> names;
    for (const auto& s : root->flat_param()->slots()) names.push_back(s.name);
    EXPECT_EQ(names, (std::vector<std::string>{"fc.weight", "fc.bias"}));
    EXPECT_EQ(tied->wte->weight.storage().nbytes(), 4u * 4u * 4u) << "kept whole";
    // Each rank its own batch: the ignored weight's gradient stays its own.
    torch::manual_seed(rank);
    const torch::Tensor x = torch::randn({3, 4});
    root->forward(x).backward();
    plain->forward(x).backward();
    ASSERT_TRUE(tied->wte->weight.grad().defined());
    EXPECT_TRUE(torch::allclose(tied->wte->weight.grad(), plain->wte->weight.grad()));
    group->barrier().wait();
  });
}

TEST(WrapRules, IgnoredModulesStayUnmanaged) {
  run_ranks_ok(2, [](int, int) {
    const auto group = start_rank();
    torch::manual_seed(0);
    nn::Sequential seq(nn::Linear(4, 8), nn::ReLU(), nn::Linear(8, 2));
    const auto ignored = seq->ptr(2);
    const auto o = FSDPOptions().ignored_modules(std::vector<std::shared_ptr<nn::Module>>{ignored});
    auto units = auto_wrap(seq, AlwaysWrapPolicy(), o);
    for (const auto& u : units) EXPECT_NE(u.path, "2") << "an ignored module was wrapped";
    FullyShardedDataParallel<nn::SequentialImpl> root(seq, o);
    EXPECT_EQ(root->flat_param(), nullptr) << "the root has nothing left to manage";
    // The ignored Linear keeps its full tensors, outside every unit.
    auto* lin = ignored->as<nn::Linear>();
    EXPECT_EQ(lin->weight.storage().nbytes(), 8u * 2u * 4u);
    EXPECT_EQ(root->parameters().size(), 3u) << "the shard of unit 0, then the ignored Linear's";
    EXPECT_TRUE(root->parameters()[1].is_same(lin->weight));
    EXPECT_EQ(root->named_parameters().size(), 4u) << "names still list every parameter";
    root->forward(torch::randn({3, 4})).sum().backward();
    EXPECT_TRUE(lin->weight.grad().defined()) << "its gradient stays local, on the tensor";

    // Wrapping the root directly: the ignored module's parameters stay out of it.
    nn::Sequential seq2(nn::Linear(4, 8), nn::ReLU(), nn::Linear(8, 2));
    FullyShardedDataParallel<nn::SequentialImpl> root2(
        seq2,
        FSDPOptions().ignored_modules(std::vector<std::shared_ptr<nn::Module>>{seq2->ptr(2)}));
    ASSERT_NE(root2->flat_param(), nullptr);
    std::vector<std::string> names;
    for (const auto& s : root2->flat_param()->slots()) names.push_back(s.name);
    EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias"}));
    group->barrier().wait();
  });
}

// As in PyTorch's FSDP: an ignored module's parameters are in parameters(),
// so the usual optimizer trains them (at one rank exactly as plain
// LibTorch), and clip_grad_norm_ counts and clips their gradients, by one
// norm on every rank (at two, each its own batch).
TEST(WrapRules, IgnoredModulesTrainThroughParameters) {
  for (const int world : {1, 2}) {
    run_ranks_ok(world, [](int rank, int world) {
      const auto group = start_rank();
      const auto make = [] {
        torch::manual_seed(0);
        return nn::Sequential(nn::Linear(4, 8), nn::ReLU(), nn::Linear(8, 2));
      };
      nn::Sequential plain = make(), seq = make();
      FullyShardedDataParallel<nn::SequentialImpl> root(
          seq,
          FSDPOptions().ignored_modules(std::vector<std::shared_ptr<nn::Module>>{seq->ptr(2)}));
      ASSERT_EQ(root->named_flat_parameters().keys(),
                (std::vector<std::string>{"_flat_param", "2.weight", "2.bias"}));
      torch::optim::AdamW opt(root->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::AdamW plain_opt(plain->parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 3; ++step) {
        torch::manual_seed(10 * rank + step);  // each rank its own batch
        const torch::Tensor x = torch::randn({5, 4});
        opt.zero_grad();
        plain_opt.zero_grad();
        root->forward(x).pow(2).sum().backward();
        plain->forward(x).pow(2).sum().backward();
        const double norm = root->clip_grad_norm_(0.5);
        // The ignored head's gradients are each rank's own: every rank still
        // clips by one norm.
        at::Tensor largest = at::full({1}, norm, at::kDouble);
        group->all_reduce(largest, ReduceOp::kMax).wait();
        EXPECT_EQ(largest.item<double>(), norm) << "step " << step;
        const double plain_norm = torch::nn::utils::clip_grad_norm_(plain->parameters(), 0.5);
        if (world == 1) EXPECT_NEAR(norm, plain_norm, 1e-5 * plain_norm) << "step " << step;
        opt.step();
        plain_opt.step();
      }
      if (world == 1) {
        SummonFullParams full(*root.ptr());
        const auto mine = root->named_parameters(), theirs = plain->named_parameters();
        for (const auto& p : theirs) {
          EXPECT_TRUE(torch::allclose(mine[p.key()], p.value(), 1e-5, 1e-6)) << p.key();
        }
      }
      group->barrier().wait();
    });
  }
}

TEST(WrapRules, BatchNormUnderMixedPrecisionStaysFullPrecision) {
  run_ranks_ok(2, [](int, int) {
    const auto group = start_rank();
    torch::manual_seed(0);
    nn::BatchNorm1d bn(8);
    nn::Sequential seq(nn::Linear(4, 8), bn, nn::ReLU(), nn::Linear(8, 2));
    const auto o = FSDPOptions().mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16));
    std::vector<std::string> warnings;
    std::vector<AutoWrappedUnit> units;
    {
      WarningCollector guard(&warnings);
      units = auto_wrap(seq, module_type_policy<nn::LinearImpl>(), o);
    }
    ASSERT_EQ(warnings.size(), 1u);
    const std::string msg = warnings[0];
    EXPECT_TRUE(contains(msg, "torch::nn::BatchNorm1dImpl at 1")) << msg;
    EXPECT_TRUE(contains(msg, "wrapped as separate FSDP units with mixed precision disabled"))
        << msg;
    ASSERT_EQ(units.size(), 3u);
    for (const auto& u : units) {
      ASSERT_NE(u.unit->flat_param(), nullptr);
      const bool bn = u.path == "1";
      EXPECT_EQ(u.unit->flat_param()->param_dtype(), bn ? torch::kFloat : torch::kBFloat16)
          << u.path;
      EXPECT_EQ(u.unit->flat_param()->shard().scalar_type(), torch::kFloat) << u.path;
      EXPECT_EQ(u.unit->casts_output_back(), bn) << u.path;
    }
    EXPECT_EQ(bn->running_mean.scalar_type(), torch::kFloat);

    FullyShardedDataParallel<nn::SequentialImpl> root(seq, o);
    torch::optim::SGD opt(root->parameters(), torch::optim::SGDOptions(0.1));
    torch::Tensor out = root->forward(torch::randn({6, 4}));
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
    out.to(torch::kFloat).pow(2).sum().backward();
    opt.step();
    EXPECT_EQ(bn->running_mean.scalar_type(), torch::kFloat);
    EXPECT_GT(bn->running_mean.abs().sum().item<double>(), 0.0) << "statistics were updated";
    for (const auto& p : root->parameters()) {
      EXPECT_EQ(p.scalar_type(), torch::kFloat);
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
    }
    group->barrier().wait();
  });
}

}  // namespace test_wrap_rules
}  // namespace fsdp::testing
