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

#include <memory>
#include <string>
#include <vector>

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

// With the schedules and features around backward that frozen units meet:
// backward prefetch after the gradient or none, forward prefetch, gradient
// accumulation under no_sync() (FULL_SHARD and SHARD_GRAD_OP), steps during
// backward (FusedAdamW), and bf16 mixed precision (finite values only:
// plain LibTorch computes in float32).
TEST(FrozenReads, WithPrefetchNoSyncStepsDuringBackwardAndMixedPrecision) {
  run_ranks_ok(2, [](int, int world) {
    join_test_group();
    using frozen_net::FrozenNet;
    using frozen_net::FrozenNetImpl;
    // A variant: whether it accumulates a micro-batch under no_sync() first,
    // steps during backward, computes in bf16.
    struct V {
      std::string name;
      FSDPOptions o;
      bool no_sync, fused, mp;
    };
    const auto base = FSDPOptions().use_orig_params(true);
    std::vector<V> vs = {
        {"post", FSDPOptions(base).backward_prefetch(BackwardPrefetch::kBackwardPost), false, false,
         false},
        {"none", FSDPOptions(base).backward_prefetch(BackwardPrefetch::kNone), false, false, false},
        {"fwd", FSDPOptions(base).forward_prefetch(true), false, false, false},
        {"nosync", base, true, false, false},
        {"nosync-grad-op", FSDPOptions(base).sharding_strategy(ShardingStrategy::kShardGradOp),
         true, false, false},
        {"fused", base, false, true, false},
        {"mp", FSDPOptions(base).mixed_precision(MixedPrecision().param_dtype(at::kBFloat16)),
         false, false, true},
    };
    for (const V& v : vs) {
      torch::manual_seed(0);
      FrozenNet reference(frozen_net::Made::kPlain, v.o);
      torch::manual_seed(0);
      auto inner = std::make_shared<FrozenNetImpl>(frozen_net::Made::kWrappers, v.o);
      FullyShardedDataParallel<FrozenNetImpl> root(inner, v.o);
      const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
      torch::optim::AdamW ref_opt(reference->parameters(), adamw);
      std::unique_ptr<torch::optim::AdamW> opt;
      if (v.fused) {
        auto f = std::make_unique<optim::FusedAdamW>(root->parameters(), adamw);
        f->step_during_backward(*root);
        opt = std::move(f);
      } else {
        opt = std::make_unique<torch::optim::AdamW>(root->parameters(), adamw);
      }
      for (int step = 0; step < 3; ++step) {
        torch::manual_seed(100 + step);
        const torch::Tensor x = torch::randn({3 * world, 6}), y = torch::randn({3 * world, 2});
        ref_opt.zero_grad();
        torch::Tensor ref_loss = torch::zeros({});
        for (int r = 0; r < world; ++r) {
          const auto xr = x.chunk(world, 0)[r], yr = y.chunk(world, 0)[r];
          ref_loss = ref_loss + torch::mse_loss(reference->forward(xr), yr);
          if (v.no_sync) ref_loss = ref_loss + torch::mse_loss(reference->forward(xr * 2), yr);
        }
        (ref_loss / world).backward();
        ref_opt.step();
        opt->zero_grad();
        // In float32: a bf16 output against a float32 target is an error in
        // LibTorch's mse_loss backward before 2.15.
        auto out = [&](const torch::Tensor& input) {
          return root->forward(input).to(torch::kFloat);
        };
        if (v.no_sync) {
          auto guard = root->no_sync();
          torch::mse_loss(out(local_block(x)), local_block(y)).backward();
        }
        torch::mse_loss(out(v.no_sync ? local_block(x) * 2 : local_block(x)), local_block(y))
            .backward();
        opt->step();
        if (!v.mp) {
          expect_same_after_step(*root.ptr(), *reference.ptr(), v.name, step);
        } else {
          SummonFullParams full(*root.ptr());
          for (const auto& p : root->parameters())
            EXPECT_TRUE(p.isfinite().all().item<bool>()) << v.name;
        }
      }
    }
  });
}
}  // namespace test_frozen_reads
}  // namespace fsdp::testing
