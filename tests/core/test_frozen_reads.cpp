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

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "core/flat_parameter.h"
#include "multi_rank.h"
#include "parity_ranks.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_frozen_reads {

namespace nn = torch::nn;

void freeze(nn::Module& m) {
  for (auto& p : m.parameters()) p.set_requires_grad(false);
}

// A frozen layer ahead of a trainable one: its node (the gradient of the
// unit's input) runs after the trainable one's AccumulateGrad.
struct FrozenFirstImpl : nn::Module {
  FrozenFirstImpl() {
    frozen = register_module("frozen", nn::Linear(8, 8));
    lin = register_module("lin", nn::Linear(8, 8));
    freeze(*frozen);
  }
  torch::Tensor forward(torch::Tensor x) { return lin(torch::tanh(frozen(x))); }
  nn::Linear frozen{nullptr}, lin{nullptr};
};
TORCH_MODULE(FrozenFirst);

// LoRA: a frozen base weight beside a trainable low-rank update.
struct LoraImpl : nn::Module {
  LoraImpl() {
    base = register_module("base", nn::Linear(8, 8));
    a = register_module("a", nn::Linear(nn::LinearOptions(8, 2).bias(false)));
    b = register_module("b", nn::Linear(nn::LinearOptions(2, 8).bias(false)));
    freeze(*base);
  }
  torch::Tensor forward(torch::Tensor x) { return base(x) + b(a(x)); }
  nn::Linear base{nullptr}, a{nullptr}, b{nullptr};
};
TORCH_MODULE(Lora);

// Frozen whole, between trainable units.
struct FrozenBlockImpl : nn::Module {
  FrozenBlockImpl() {
    lin = register_module("lin", nn::Linear(8, 8));
    freeze(*lin);
  }
  torch::Tensor forward(torch::Tensor x) { return x + torch::tanh(lin(x)); }
  nn::Linear lin{nullptr};
};
TORCH_MODULE(FrozenBlock);

// kCheckpointed: wrappers whose blocks checkpoint their activations (LoRA's
// usual company): backward recomputes them and reads the frozen weights.
enum class Made { kPlain, kWrappers, kCheckpointed, kFullyShard };

struct FrozenNetImpl : nn::Module {
  FrozenNetImpl(Made made, const FSDPOptions& options) {
    stem = register_module("stem", nn::Linear(6, 8));
    auto add = [&](const std::string& name, auto module) {
      using Impl = typename decltype(module)::Impl;
      const auto block_options =
          FSDPOptions(options).activation_checkpointing(made == Made::kCheckpointed);
      nn::AnyModule any = made == Made::kWrappers || made == Made::kCheckpointed
                              ? nn::AnyModule(FullyShardedDataParallel<Impl>(module, block_options))
                              : nn::AnyModule(module);
      register_module(name, any.ptr());
      blocks.push_back(std::move(any));
    };
    add("mixed", FrozenFirst());
    add("frozen", FrozenBlock());
    add("lora", Lora());
    head = register_module("head", nn::Linear(8, 2));
  }
  torch::Tensor forward(torch::Tensor x) {
    const torch::Tensor h = stem(x);
    x = h;
    for (auto& block : blocks) x = block.forward(x);
    // After the blocks' own hooks on it.
    if (probe) h.register_hook([this](const torch::Tensor&) { probe(); });
    return head(x);
  }
  nn::Linear stem{nullptr}, head{nullptr};
  std::vector<nn::AnyModule> blocks;
  // Runs when backward has passed every block (the stem output's gradient).
  std::function<void()> probe;
};
TORCH_MODULE(FrozenNet);

// How a step computes its loss: one forward; two forwards before one
// backward (both graphs read the frozen parameters); a gradient penalty (a
// backward that builds a graph, then the backward through it).
enum class Loss { kOneForward, kTwoForwards, kGradientPenalty };

torch::Tensor loss_of(const std::function<torch::Tensor(torch::Tensor)>& f, const torch::Tensor& x,
                      const torch::Tensor& y, Loss how) {
  switch (how) {
    case Loss::kOneForward:
      return torch::mse_loss(f(x), y);
    case Loss::kTwoForwards:
      return torch::mse_loss(f(x), y) + torch::mse_loss(f(x * 2), y);
    default: {
      const torch::Tensor input = x.detach().requires_grad_();
      const torch::Tensor out = f(input);
      const torch::Tensor g =
          torch::autograd::grad({out.sum()}, {input}, {},
                                /*retain_graph=*/true, /*create_graph=*/true)[0];
      return torch::mse_loss(out, y) + g.pow(2).mean();
    }
  }
}

void train_and_compare(Made made, ShardingStrategy strategy, Loss how) {
  const int world = rank_and_world().second;
  const bool wrapped = made != Made::kFullyShard;
  const char* const made_names[] = {"plain ", "wrappers ", "checkpointed ", "fully_shard "};
  const std::string what = std::string(made_names[static_cast<int>(made)]) + to_string(strategy) +
                           " loss " + std::to_string(static_cast<int>(how));
  const auto options = FSDPOptions().sharding_strategy(strategy).use_orig_params(true);
  torch::manual_seed(0);
  FrozenNet reference(Made::kPlain, options);
  torch::manual_seed(0);
  auto inner = std::make_shared<FrozenNetImpl>(made, options);
  std::shared_ptr<nn::Module> model;
  std::function<torch::Tensor(torch::Tensor)> forward;
  std::vector<torch::Tensor> params;
  if (wrapped) {
    FullyShardedDataParallel<FrozenNetImpl> root(inner, options);
    params = root->parameters();
    model = root.ptr();
    forward = [root](torch::Tensor x) mutable { return root->forward(x); };
  } else {
    forward = [inner](torch::Tensor x) { return inner->forward(x); };
    for (auto& block : inner->blocks) fully_shard(*block.ptr(), options);
    params = fully_shard(*inner, options).flat_parameters();
    model = inner;
  }
  // Wrappers see their inputs: after one forward, every block has resharded
  // by the time backward reaches the stem (a fully_shard unit with frozen
  // parameters keeps them to the end of backward).
  int probed = 0;
  if (wrapped && how == Loss::kOneForward) {
    inner->probe = [&] {
      ++probed;
      for (size_t i = 0; i < inner->blocks.size(); ++i) {
        EXPECT_EQ(unit_of(*inner->blocks[i].ptr())->flat_param()->state(),
                  FlatParameter::State::kSharded)
            << what << ": block " << i << " still gathered";
      }
    };
  }
  const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  torch::optim::AdamW ref_opt(reference->parameters(), adamw), opt(params, adamw);
  const auto plain = [&](torch::Tensor x) { return reference->forward(x); };
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(100 + step);
    const torch::Tensor x = torch::randn({3 * world, 6}), y = torch::randn({3 * world, 2});
    ref_opt.zero_grad();
    torch::Tensor ref_loss = torch::zeros({});
    for (int r = 0; r < world; ++r) {
      ref_loss = ref_loss + loss_of(plain, x.chunk(world, 0)[r], y.chunk(world, 0)[r], how);
    }
    (ref_loss / world).backward();
    ref_opt.step();
    opt.zero_grad();
    loss_of(forward, local_block(x), local_block(y), how).backward();
    opt.step();
    expect_same_after_step(*model, *reference.ptr(), what, step);
  }
  if (wrapped && how == Loss::kOneForward) EXPECT_EQ(probed, 3) << what;
}

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
