// fsdp::wrap() inside and outside an EnableWrap scope (PyTorch's enable_wrap).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include "core/flat_parameter.h"
#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_enable_wrap {

struct TwoLayerImpl : torch::nn::Module {
  TwoLayerImpl() {
    // The model code calls wrap() unconditionally, as with PyTorch's wrap().
    a = register_module("a", wrap(torch::nn::Linear(6, 6)));
    // PyTorch's wrap(module, **wrap_overrides): the head frees its
    // parameters after forward whatever the scope says.
    b = register_module("b", wrap(torch::nn::Linear(6, 2), [](FSDPOptions& o) {
                          o.sharding_strategy(ShardingStrategy::kFullShard);
                        }));
  }
  torch::Tensor forward(torch::Tensor x) { return b(torch::relu(a(x))); }
  FullyShardedDataParallel<torch::nn::LinearImpl> a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoLayer);

TEST(EnableWrap, WrapMakesUnitsOnlyInsideAScope) {
  for (const int world : parity_world_sizes()) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks_ok(world, [](int, int) {
      init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
      torch::manual_seed(0);
      TwoLayer plain;  // outside any scope: pass-through wrappers
      torch::manual_seed(0);
      TwoLayer reference;  // the same, never wrapped: plain LibTorch on every rank's data
      EXPECT_EQ(EnableWrap::current(), nullptr);
      EXPECT_FALSE(plain->a->enabled());
      EXPECT_EQ(plain->a->flat_param(), nullptr);
      EXPECT_EQ(plain->a->parameters().size(), 2u);  // the Linear's own weight and bias
      // The Unit's API says the same (a review found it empty: an optimizer
      // built from named_flat_parameters() trained nothing).
      EXPECT_EQ(plain->a->flat_parameters().size(), 2u);
      EXPECT_EQ(plain->a->named_flat_parameters().keys(),
                (std::vector<std::string>{"weight", "bias"}));
      torch::manual_seed(0);
      TwoLayer wrapped = [] {
        EnableWrap scope(FSDPOptions().sharding_strategy(ShardingStrategy::kShardGradOp));
        {
          EnableWrap inner(FSDPOptions().sharding_strategy(ShardingStrategy::kNoShard));
          EXPECT_EQ(EnableWrap::current()->sharding_strategy(), ShardingStrategy::kNoShard);
        }
        EXPECT_EQ(EnableWrap::current()->sharding_strategy(), ShardingStrategy::kShardGradOp);
        return TwoLayer();
      }();
      EXPECT_EQ(EnableWrap::current(), nullptr);
      ASSERT_NE(wrapped->a->flat_param(), nullptr);
      EXPECT_EQ(wrapped->a->fsdp_options().sharding_strategy(), ShardingStrategy::kShardGradOp);
      EXPECT_EQ(wrapped->b->fsdp_options().sharding_strategy(), ShardingStrategy::kFullShard)
          << "wrap()'s overrides were not applied";
      EXPECT_FALSE(plain->b->enabled()) << "overrides made a unit outside a scope";
      EXPECT_EQ(wrapped->a->flat_param()->state(), FlatParameter::State::kSharded);

      // Same names either way, and the same training.
      EXPECT_EQ(plain->named_parameters().keys(), wrapped->named_parameters().keys());
      FullyShardedDataParallel<TwoLayerImpl> root(wrapped);
      FullyShardedDataParallel<TwoLayerImpl> plain_root(plain);  // its pass-throughs are not units
      ASSERT_NE(plain_root->flat_param(), nullptr);
      EXPECT_EQ(plain_root->flat_param()->slots().size(), 4u) << "the root manages all four";
      // fully_shard sees the Linears through the pass-throughs (PyTorch's
      // wrap() outside enable_wrap returns the module itself).
      torch::manual_seed(0);
      TwoLayer in_place;
      Unit& in_place_root = fully_shard(in_place, module_type_policy<torch::nn::LinearImpl>());
      EXPECT_NE(unit_of(*in_place->a), nullptr);
      EXPECT_NE(unit_of(*in_place->b), nullptr);
      EXPECT_FALSE(in_place->a->enabled()) << "the wrapper itself stays a pass-through";
      torch::optim::SGD opt_c(in_place_root.flat_parameters(), torch::optim::SGDOptions(0.1));
      torch::optim::SGD opt_a(root->parameters(), torch::optim::SGDOptions(0.1));
      torch::optim::SGD opt_b(plain_root->parameters(), torch::optim::SGDOptions(0.1));
      torch::optim::SGD opt_ref(reference->parameters(), torch::optim::SGDOptions(0.1));
      const int world = rank_and_world().second;
      for (int step = 0; step < 3; ++step) {
        torch::manual_seed(10 + step);
        const torch::Tensor global = torch::randn({4 * world, 6});
        opt_a.zero_grad();
        root->forward(local_block(global)).pow(2).sum().backward();
        opt_a.step();
        opt_b.zero_grad();
        plain_root->forward(local_block(global)).pow(2).sum().backward();
        opt_b.step();
        in_place->zero_grad();
        in_place->forward(local_block(global)).pow(2).sum().backward();
        opt_c.step();
        opt_ref.zero_grad();
        (reference->forward(global).pow(2).sum() / world).backward();
        opt_ref.step();
        expect_same_after_step(*root.ptr(), *reference, "wrap() inside a scope", step);
        expect_same_after_step(*plain_root.ptr(), *reference, "wrap() outside a scope", step);
        {
          SummonFullParams full(*in_place);
          expect_same_params(*in_place, *reference, "fully_shard through pass-throughs");
        }
      }
    });
  }
}

}  // namespace test_enable_wrap
}  // namespace fsdp::testing
