// Handing the reduced gradient to the optimizer's tensors (Note [Handing over
// the reduced gradient]): replaced when zeroed, added otherwise, and the same
// training as plain LibTorch either way.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include "detail/torch_compat.h"
#include "multi_rank.h"
#include "runtime/reduced_grad.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_reduced_grad {

using detail::accumulate_reduced_grad;
using detail::all_zero_bits;

TEST(ReducedGrad, AllZeroBitsFindsAnyNonZeroByte) {
  // 1000 floats: 15 whole 256-byte blocks and a 160-byte tail.
  at::Tensor t = torch::zeros({1000});
  EXPECT_TRUE(all_zero_bits(t));
  EXPECT_TRUE(all_zero_bits(torch::zeros({0})));
  for (int64_t i : {0, 63, 64, 500, 959, 960, 999}) {
    t.zero_();
    t[i] = 1e-30;
    EXPECT_FALSE(all_zero_bits(t)) << "non-zero element " << i;
    t[i] = -0.0;  // equal to zero, but not +0.0: an add would change its sign
    EXPECT_FALSE(all_zero_bits(t)) << "-0.0 at element " << i;
  }
  // Not read, so never taken for zero.
  EXPECT_FALSE(all_zero_bits(torch::zeros({8, 8}).t()));
  EXPECT_TRUE(all_zero_bits(torch::zeros({7}, at::kBFloat16)));
}

TEST(ReducedGrad, UndefinedGradientTakesTheReducedOneAndCopiesViews) {
  at::Tensor param = torch::zeros({6}, torch::requires_grad());
  at::Tensor reduced = torch::arange(6.0);
  accumulate_reduced_grad(param, reduced);
  EXPECT_TRUE(param.grad().is_same(reduced));

  at::Tensor piece_param = torch::zeros({3}, torch::requires_grad());
  at::Tensor whole = torch::arange(6.0);
  accumulate_reduced_grad(piece_param, whole.narrow(0, 3, 3));
  EXPECT_NE(piece_param.grad().data_ptr(), whole.narrow(0, 3, 3).data_ptr());
  EXPECT_TRUE(torch::equal(piece_param.grad(), torch::tensor({3.0, 4.0, 5.0})));
}

TEST(ReducedGrad, ZeroedGradientTakesTheReducedStorageInTheSameTensor) {
  at::Tensor param = torch::zeros({1000}, torch::requires_grad());
  param.mutable_grad() = torch::zeros({1000});
  const at::Tensor held = param.grad();  // what a user may keep across steps
  at::Tensor reduced = torch::randn({1000});
  accumulate_reduced_grad(param, reduced);
  EXPECT_TRUE(param.grad().is_same(held)) << "the gradient tensor was replaced, not refilled";
  EXPECT_EQ(held.data_ptr(), reduced.data_ptr()) << "the zeroed gradient was added to";
  EXPECT_TRUE(torch::equal(held, reduced));
}

TEST(ReducedGrad, NonZeroGradientsAndViewsAreAddedTo) {
  at::Tensor reduced = torch::randn({1000});
  // A gradient kept from an earlier step (no zero_grad in between).
  at::Tensor param = torch::zeros({1000}, torch::requires_grad());
  at::Tensor old = torch::zeros({1000});
  old[999] = 2.0;
  param.mutable_grad() = old.clone();
  const void* storage = param.grad().data_ptr();
  accumulate_reduced_grad(param, reduced);
  EXPECT_EQ(param.grad().data_ptr(), storage);
  EXPECT_TRUE(torch::equal(param.grad(), old + reduced));

  // A zeroed gradient that is a view of something else keeps its storage.
  at::Tensor base = torch::zeros({2000});
  param.mutable_grad() = base.narrow(0, 1000, 1000);
  accumulate_reduced_grad(param, reduced);
  EXPECT_TRUE(torch::equal(base.narrow(0, 1000, 1000), reduced));

  // A zeroed gradient given a view of the reduced buffer copies it.
  at::Tensor whole = torch::randn({2000});
  param.mutable_grad() = torch::zeros({1000});
  storage = param.grad().data_ptr();
  accumulate_reduced_grad(param, whole.narrow(0, 0, 1000));
  EXPECT_EQ(param.grad().data_ptr(), storage);
  EXPECT_TRUE(torch::equal(param.grad(), whole.narrow(0, 0, 1000)));
}

// FSDP with zeroing zero_grad() (1.13's default, zero_grad(false) in 2.x) and with gradients kept
// across two steps (accumulation): the same parameters as plain training, in
// every strategy, and the optimizer's gradient tensors stay the same objects.
TEST(ReducedGrad, ZeroedAndAccumulatedGradientsTrainAsPlainLibTorch) {
  run_ranks_ok(2, [](int, int world) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                          ShardingStrategy::kNoShard}) {
      for (bool orig : {false, true}) {
        const std::string what =
            std::string(to_string(strategy)) + (orig ? " use_orig_params" : "");
        auto [reference, model] =
            make_net_twins(FSDPOptions().sharding_strategy(strategy).use_orig_params(orig));
        torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
        std::vector<at::Tensor> held;
        std::vector<const void*> storage;
        for (int step = 0; step < 4; ++step) {
          torch::manual_seed(step);
          const torch::Tensor x = torch::randn({8 * world, 7});  // each rank: its block
          // Steps 0 and 2 zero the gradients; 1 and 3 add to the previous ones.
          if (step % 2 == 0) {
            compat::zero_grad_in_place(ref_opt);
            compat::zero_grad_in_place(opt);
          }
          (reference->forward(x).pow(2).sum() / world).backward();
          ref_opt.step();
          model->forward(local_block(x)).pow(2).sum().backward();
          opt.step();
          const auto params = model->parameters();
          if (step == 1) {
            for (const auto& p : params) {
              held.push_back(p.grad());
              storage.push_back(p.grad().data_ptr());
            }
          }
          for (size_t i = 0; step >= 2 && i < params.size(); ++i) {
            const at::Tensor& grad = params[i].grad();
            EXPECT_TRUE(grad.is_same(held[i])) << what << ": gradient " << i;
            // Step 2's zeroed flat gradients take the reduced buffers' storage
            // (the fast path ran); step 3 adds in place. Pieces are views of
            // the reduced buffer, so they are always written in place.
            if (step == 2 && !orig) {
              EXPECT_NE(grad.data_ptr(), storage[i]) << what << ": zeroed gradient added to";
              storage[i] = grad.data_ptr();
            } else {
              EXPECT_EQ(grad.data_ptr(), storage[i]) << what << ": gradient " << i << " moved";
            }
          }
        }
        SummonFullParams full(*model.ptr());
        expect_same_params(*model.ptr(), *reference.ptr(), what);
      }
    }
  });
}

}  // namespace test_reduced_grad
}  // namespace fsdp::testing
