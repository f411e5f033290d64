#pragma once

// Small models shared by the core tests.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
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

/// Trains `reference` (plain LibTorch) and `model` (its FSDP twin, same
/// initial weights) side by side: `steps` SGD steps (lr 0.1, `momentum`) on
/// the loss sum(out^2) of the same random inputs of `input_shape` (seeded by
/// the step), then compares the full parameters (expect_same_params).
template <typename Reference, typename Wrapped>
void expect_same_training(Reference& reference, Wrapped& model,
                          const std::vector<int64_t>& input_shape, int steps, double momentum,
                          const std::string& what) {
  torch::optim::SGD ref_opt(reference.parameters(),
                            torch::optim::SGDOptions(0.1).momentum(momentum));
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1).momentum(momentum));
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(step);
    const torch::Tensor x = torch::randn(input_shape);
    ref_opt.zero_grad();
    reference.forward(x).pow(2).sum().backward();
    ref_opt.step();
    opt.zero_grad();
    model.forward(x).pow(2).sum().backward();
    opt.step();
  }
  SummonFullParams full(model);
  expect_same_params(model, reference, what);
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

}  // namespace fsdp::testing
