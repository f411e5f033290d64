// The model and training loop of Note [Parameters backward reads without a
// gradient]'s tests, on the CPU (test_frozen_reads.cpp) and on a GPU
// (test_cuda_units.cpp): units whose frozen parameters backward reads after
// their gradients arrived, trained against plain LibTorch every step.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "core/flat_parameter.h"
#include "test_models.h"

namespace fsdp::testing {
namespace frozen_net {

namespace nn = torch::nn;

inline void freeze(nn::Module& m) {
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
  FrozenNetImpl(Made made, const FSDPOptions& options, const torch::Device& device = torch::kCPU) {
    stem = register_module("stem", nn::Linear(6, 8));
    stem->to(device);
    auto add = [&](const std::string& name, auto module) {
      using Impl = typename decltype(module)::Impl;
      module->to(device);  // before wrapping, as a user moves a model
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
    head->to(device);
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

inline torch::Tensor loss_of(const std::function<torch::Tensor(torch::Tensor)>& f,
                             const torch::Tensor& x, const torch::Tensor& y, Loss how) {
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

inline void train_and_compare(Made made, ShardingStrategy strategy, Loss how,
                              const torch::Device& device = torch::kCPU) {
  const int world = rank_and_world().second;
  const bool wrapped = made != Made::kFullyShard;
  const char* const made_names[] = {"plain ", "wrappers ", "checkpointed ", "fully_shard "};
  const std::string what = std::string(made_names[static_cast<int>(made)]) + to_string(strategy) +
                           " loss " + std::to_string(static_cast<int>(how));
  const auto options = FSDPOptions().sharding_strategy(strategy).use_orig_params(true);
  torch::manual_seed(0);
  FrozenNet reference(Made::kPlain, options);
  reference->to(device);
  torch::manual_seed(0);
  auto inner = std::make_shared<FrozenNetImpl>(made, options, device);
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
  // After one forward, every block has resharded by the time backward
  // reaches the stem: wrappers hook their inputs, fully_shard's units the
  // arguments of the operators on their parameters (they kept the frozen
  // ones to the end of backward).
  int probed = 0;
  if (how == Loss::kOneForward) {
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
    const torch::Tensor x = torch::randn({3 * world, 6}).to(device);
    const torch::Tensor y = torch::randn({3 * world, 2}).to(device);
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
  if (how == Loss::kOneForward) EXPECT_EQ(probed, 3) << what;
}

}  // namespace frozen_net
}  // namespace fsdp::testing
