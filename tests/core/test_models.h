#pragma once

// Small models shared by the core tests.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/fsdp.h>

namespace fsdp::testing {

/// Parity check: `actual` (an FSDP model whose full parameters are gathered,
/// e.g. under SummonFullParams) has exactly `expected`'s parameter names, and
/// each equals the reference within the seeds' tolerance (atol 1e-5, rtol
/// 1.3e-6) with the same requires_grad. `what` labels failures.
inline void expect_same_params(torch::nn::Module& actual, torch::nn::Module& expected,
                               const std::string& what) {
  auto exp = expected.named_parameters();
  auto act = actual.named_parameters();
  ASSERT_EQ(act.size(), exp.size()) << what;
  for (const auto& p : exp) {
    const torch::Tensor* a = act.find(p.key());
    ASSERT_NE(a, nullptr) << what << ": missing parameter " << p.key();
    EXPECT_TRUE(torch::allclose(*a, p.value(), /*rtol=*/1.3e-6, /*atol=*/1e-5))
        << what << " " << p.key() << " max diff " << (*a - p.value()).abs().max().item<double>();
    EXPECT_EQ(a->requires_grad(), p.value().requires_grad()) << what << " " << p.key();
  }
}

/// This process's rank and the world size of the default process group
/// (0 and 1 when none is initialised).
inline std::pair<int, int> rank_and_world() {
  if (!is_initialized()) return {0, 1};
  return {default_process_group()->rank(), default_process_group()->size()};
}

/// Data parallelism as parity tests check it: `global` is the batch of all
/// ranks (world blocks along dim 0, the same tensor on every rank, which plain
/// LibTorch trains on); each rank trains on its own block. Different data per
/// rank, so a missing or wrong gradient reduction changes the result.
inline torch::Tensor local_block(const torch::Tensor& global) {
  const auto [rank, world] = rank_and_world();
  TORCH_CHECK(global.size(0) % world == 0, "global batch not divisible by the world size");
  return global.chunk(world, 0)[rank];
}

/// The parameters of `module` by name: detached copies that keep requires_grad.
using ParamSnapshot = std::vector<std::pair<std::string, torch::Tensor>>;
inline ParamSnapshot snapshot_params(torch::nn::Module& module) {
  ParamSnapshot out;
  for (const auto& p : module.named_parameters()) {
    torch::Tensor copy = p.value().detach().clone();
    copy.set_requires_grad(p.value().requires_grad());
    out.emplace_back(p.key(), copy);
  }
  return out;
}

/// Two trainings compared step by step: the same names in the same order and
/// values within the seeds' tolerance (atol 1e-5, rtol 1.3e-6), and the same
/// requires_grad when `check_requires_grad`. `what` labels failures.
inline void expect_same_history(const std::vector<ParamSnapshot>& actual,
                                const std::vector<ParamSnapshot>& expected, const std::string& what,
                                bool check_requires_grad = true) {
  ASSERT_EQ(actual.size(), expected.size()) << what << ": steps";
  for (size_t step = 0; step < expected.size(); ++step) {
    const std::string at = what + " step " + std::to_string(step);
    ASSERT_EQ(actual[step].size(), expected[step].size()) << at;
    for (size_t i = 0; i < expected[step].size(); ++i) {
      const auto& [name, want] = expected[step][i];
      const torch::Tensor& got = actual[step][i].second;
      EXPECT_EQ(actual[step][i].first, name) << at;
      EXPECT_TRUE(torch::allclose(got, want, /*rtol=*/1.3e-6, /*atol=*/1e-5))
          << at << " " << name << " max diff " << (got - want).abs().max().item<double>();
      if (check_requires_grad)
        EXPECT_EQ(got.requires_grad(), want.requires_grad()) << at << " " << name;
    }
  }
}

/// Adds each parameter's .grad into `sum` under its name (a copy the first
/// time): a reference's gradients summed over the ranks' batches, in rank order.
inline void add_grads(std::map<std::string, torch::Tensor>& sum,
                      const torch::OrderedDict<std::string, torch::Tensor>& params) {
  for (const auto& p : params) {
    auto it = sum.find(p.key());
    if (it == sum.end()) {
      sum[p.key()] = p.value().grad().clone();
    } else {
      it->second.add_(p.value().grad());
    }
  }
}

/// `global` when training plain LibTorch on every rank's data, this rank's
/// block of it (local_block) when training with FSDP.
inline torch::Tensor batch_for(const torch::Tensor& global, bool sharded) {
  return sharded ? local_block(global) : global;
}

/// The world sizes every parity test runs at.
inline const std::vector<int>& parity_world_sizes() {
  static const std::vector<int> sizes = {1, 2, 3};
  return sizes;
}

/// The units among `model`'s modules (itself included), in registration order.
inline std::vector<Unit*> units_of(torch::nn::Module& model) {
  std::vector<Unit*> out;
  for (const auto& m : model.modules()) {
    if (auto* u = dynamic_cast<Unit*>(m.get())) out.push_back(u);
  }
  return out;
}

/// The strategies the parity tests train with (hybrid sharding has tests of
/// its own).
inline const std::vector<ShardingStrategy>& parity_strategies() {
  static const std::vector<ShardingStrategy> strategies = {
      ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard};
  return strategies;
}

/// FGSM's adversarial example as usually written: the gradient of the mse
/// loss with respect to the input alone (no parameter gets one), then the
/// input moved along its sign.
template <typename Model>
torch::Tensor fgsm(Model& model, const torch::Tensor& x, const torch::Tensor& y) {
  const torch::Tensor input = x.detach().requires_grad_(true);
  const torch::Tensor loss = torch::mse_loss(model->forward(input), y);
  return (x + 0.05 * torch::autograd::grad({loss}, {input})[0].sign()).detach();
}

/// Parity after one step: gathers `model`'s full parameters and compares
/// them with `reference`'s (expect_same_params). Collective.
template <typename Wrapped>
void expect_same_after_step(Wrapped& model, torch::nn::Module& reference, const std::string& what,
                            int step) {
  SummonFullParams full(model);
  expect_same_params(model, reference, what + " step " + std::to_string(step));
}

/// Trains `reference` (plain LibTorch) and `model` (its FSDP twin, same
/// initial weights) side by side: `steps` SGD steps (lr 0.1, `momentum`).
/// Each step draws a global batch of world x `input_shape` (seeded by the
/// step); each rank trains on its block with the loss sum(out^2), the
/// reference on the whole batch with sum(out^2) / world (what averaging the
/// ranks' gradients computes). The full parameters are compared every step.
template <typename Reference, typename Wrapped>
void expect_same_training(Reference& reference, Wrapped& model,
                          const std::vector<int64_t>& input_shape, int steps, double momentum,
                          const std::string& what) {
  const int world = rank_and_world().second;
  torch::optim::SGD ref_opt(reference.parameters(),
                            torch::optim::SGDOptions(0.1).momentum(momentum));
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1).momentum(momentum));
  std::vector<int64_t> global_shape = input_shape;
  global_shape[0] *= world;
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(step);
    const torch::Tensor global = torch::randn(global_shape);
    ref_opt.zero_grad();
    (reference.forward(global).pow(2).sum() / world).backward();
    ref_opt.step();
    opt.zero_grad();
    model.forward(local_block(global)).pow(2).sum().backward();
    opt.step();
    expect_same_after_step(model, reference, what, step);
  }
}

// fc1 and block are units when wrapped; head and the one-element `scale` are
// managed by the root unit.
struct NetImpl : torch::nn::Module {
  NetImpl(bool wrap, const FSDPOptions& o) {
    torch::nn::Linear l1(7, 16);
    torch::nn::Sequential b(torch::nn::Linear(16, 16), torch::nn::GELU(),
                            torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})),
                            torch::nn::Linear(16, 16));
    if (wrap) {
      fc1 = torch::nn::AnyModule(FullyShardedDataParallel<torch::nn::LinearImpl>(l1, o));
      block = torch::nn::AnyModule(FullyShardedDataParallel<torch::nn::SequentialImpl>(b, o));
      register_module("block", block.ptr());
    } else {
      fc1 = torch::nn::AnyModule(l1);
      plain_block = register_module("block", b);
    }
    register_module("fc1", fc1.ptr());
    head = register_module("head", torch::nn::Linear(16, 3));
    scale = register_parameter("scale", torch::full({1}, 0.5));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1.forward(x));
    x = x + (plain_block ? plain_block->forward(x) : block.forward(x));
    return head(x) * scale;
  }
  torch::nn::AnyModule fc1, block;
  torch::nn::Sequential plain_block{nullptr};
  torch::nn::Linear head{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(Net);

/// A plain Net and its wrapped twin (nested units fc1 and block in the
/// root), made with the same initial weights.
struct NetTwins {
  Net reference;
  FullyShardedDataParallel<NetImpl> model;
};
inline NetTwins make_net_twins(const FSDPOptions& options) {
  torch::manual_seed(0);
  Net reference(false, FSDPOptions());
  torch::manual_seed(0);
  return {reference,
          FullyShardedDataParallel<NetImpl>(std::make_shared<NetImpl>(true, options), options)};
}

// A module that holds another module's weight as its own parameter: how a
// LibTorch model ties weights (Module has no unregister_parameter).
struct SharedWeightImpl : torch::nn::Module {
  explicit SharedWeightImpl(const torch::Tensor& w) : weight(register_parameter("weight", w)) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(SharedWeight);

}  // namespace fsdp::testing
