// fsdp::optim::FusedAdamW and FusedSGD (Note [Fused host optimizers]) step
// exactly as torch::optim::AdamW and SGD do, to float rounding, over 100
// steps: every option, several parameter groups, parameters the kernel takes
// and ones it leaves to LibTorch's operations (another dtype, a transposed
// view), parameters without a gradient on some steps. Their state is
// LibTorch's: torch::save of one loads into the other and training goes on
// identically.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/optim/fused.h>

#include "detail/torch_compat.h"
#include "error_of.h"
#include "optim/fused_kernels.h"

namespace fsdp::testing {
namespace test_fused_optim {

constexpr double kTolerance = 1e-6;
constexpr int kSteps = 100;

// One set of parameters: a large one (several threads' tasks), a matrix, a
// transposed view (not contiguous), a float64 vector, and one that has no
// gradient on odd steps.
std::vector<torch::Tensor> make_params() {
  torch::manual_seed(7);
  std::vector<torch::Tensor> params = {torch::randn({150000}), torch::randn({64, 33}),
                                       torch::randn({33, 20}).t(),
                                       torch::randn({50}, torch::kFloat64), torch::randn({40})};
  for (auto& p : params) p = p.detach().requires_grad_();
  return params;
}

std::vector<torch::Tensor> copies(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) {
    auto c = p.detach().clone();
    if (!p.is_contiguous()) c = p.detach().t().clone().t();  // keep the layout
    out.push_back(c.requires_grad_());
  }
  return out;
}

// The same gradients on both sets; the last parameter gets none on odd steps.
void set_grads(std::vector<torch::Tensor>& a, std::vector<torch::Tensor>& b, int step) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (i + 1 == a.size() && step % 2 == 1) {
      a[i].mutable_grad() = torch::Tensor();
      b[i].mutable_grad() = torch::Tensor();
      continue;
    }
    auto g = torch::randn(a[i].sizes(), a[i].options());
    if (!a[i].is_contiguous()) g = g.t().contiguous().t();
    a[i].mutable_grad() = g.clone();
    b[i].mutable_grad() = g.clone();
  }
}

void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    const double diff = (a[i] - b[i]).abs().max().item<double>();
    EXPECT_LE(diff, kTolerance * (1 + b[i].abs().max().item<double>())) << "parameter " << i;
  }
}

template <typename Options>
std::vector<torch::optim::OptimizerParamGroup> groups(const std::vector<torch::Tensor>& params,
                                                      const std::vector<Options>& options) {
  // Parameters round-robin over the groups, so each group has several kinds.
  std::vector<std::vector<torch::Tensor>> lists(options.size());
  for (size_t i = 0; i < params.size(); ++i) lists[i % options.size()].push_back(params[i]);
  std::vector<torch::optim::OptimizerParamGroup> out;
  for (size_t g = 0; g < options.size(); ++g)
    out.emplace_back(lists[g], std::make_unique<Options>(options[g]));
  return out;
}

std::vector<torch::optim::AdamWOptions> adamw_options() {
  return {
      torch::optim::AdamWOptions(1e-2),  // weight decay 1e-2 by default
      torch::optim::AdamWOptions(3e-3).weight_decay(0).amsgrad(true).betas({0.8, 0.99}).eps(1e-6),
      torch::optim::AdamWOptions(5e-3).weight_decay(0.1).amsgrad(true)};
}

std::vector<torch::optim::SGDOptions> sgd_options() {
  return {torch::optim::SGDOptions(1e-2).momentum(0.9).dampening(0.1).weight_decay(1e-4),
          torch::optim::SGDOptions(2e-2).momentum(0.9).nesterov(true),
          torch::optim::SGDOptions(5e-2).weight_decay(1e-3)};
}

TEST(FusedOptim, AdamWStepsAsTorchAdamWOver100Steps) {
  auto ours = make_params();
  auto theirs = copies(ours);
  fsdp::optim::FusedAdamW fused(groups(ours, adamw_options()));
  torch::optim::AdamW reference(groups(theirs, adamw_options()));
  for (int step = 0; step < kSteps; ++step) {
    set_grads(ours, theirs, step);
    fused.step();
    reference.step();
  }
  expect_close(ours, theirs);
  for (size_t i = 0; i < ours.size(); ++i) {
    const auto& a = static_cast<const torch::optim::AdamWParamState&>(
        *fused.state().at(compat::optim_state_key(fused.state(), ours[i])));
    const auto& b = static_cast<const torch::optim::AdamWParamState&>(
        *reference.state().at(compat::optim_state_key(reference.state(), theirs[i])));
    EXPECT_EQ(a.step(), b.step()) << "parameter " << i;
    EXPECT_TRUE(torch::allclose(a.exp_avg(), b.exp_avg(), kTolerance, kTolerance));
    EXPECT_TRUE(torch::allclose(a.exp_avg_sq(), b.exp_avg_sq(), kTolerance, kTolerance));
    EXPECT_EQ(a.max_exp_avg_sq().defined(), b.max_exp_avg_sq().defined());
  }
}

// AMSGrad's running maximum is at::maximum's: a NaN already in it (a state
// loaded from a diverged run) stays, as AdamW keeps it, at the first
// element and the last alike.
TEST(FusedOptim, AmsgradMaximumKeepsANaNAsAdamWDoes) {
  auto ours = make_params();
  auto theirs = copies(ours);
  const auto options = torch::optim::AdamWOptions(1e-2).amsgrad(true);
  fsdp::optim::FusedAdamW fused({ours[0]}, options);
  torch::optim::AdamW reference({theirs[0]}, options);
  const auto max_sq = [](torch::optim::Optimizer& opt, const torch::Tensor& p) {
    return static_cast<torch::optim::AdamWParamState&>(
               *opt.state().at(compat::optim_state_key(opt.state(), p)))
        .max_exp_avg_sq();
  };
  const int64_t n = ours[0].numel();
  for (int step = 0; step < 3; ++step) {
    set_grads(ours, theirs, step);
    fused.step();
    reference.step();
    if (step == 0) {
      for (const int64_t i : {int64_t{0}, n - 1}) {
        max_sq(fused, ours[0]).view({-1})[i] = NAN;
        max_sq(reference, theirs[0]).view({-1})[i] = NAN;
      }
    }
  }
  EXPECT_TRUE(torch::allclose(max_sq(fused, ours[0]), max_sq(reference, theirs[0]), kTolerance,
                              kTolerance, /*equal_nan=*/true));
  EXPECT_TRUE(torch::allclose(ours[0], theirs[0], kTolerance, kTolerance, /*equal_nan=*/true));
  EXPECT_TRUE(max_sq(fused, ours[0]).view({-1})[n - 1].isnan().item<bool>());
}

TEST(FusedOptim, SGDStepsAsTorchSGDOver100Steps) {
  auto ours = make_params();
  auto theirs = copies(ours);
  fsdp::optim::FusedSGD fused(groups(ours, sgd_options()), torch::optim::SGDOptions(0.1));
  torch::optim::SGD reference(groups(theirs, sgd_options()), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < kSteps; ++step) {
    set_grads(ours, theirs, step);
    fused.step();
    reference.step();
  }
  expect_close(ours, theirs);
  EXPECT_EQ(fused.state().size(), reference.state().size());
}

// at::parallel_for is a template: compiled without LibTorch's OpenMP, the
// kernels' loop ran on one thread whatever the intra-op setting (seen on a
// 16-core GPU machine: 15 GB/s where a copy moved 73). Two threads asked for,
// two used.
TEST(FusedOptim, KernelsUseTheIntraOpThreads) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  EXPECT_EQ(detail::kernel_threads_used(int64_t{1} << 20), 2);
  at::set_num_threads(1);
  EXPECT_EQ(detail::kernel_threads_used(int64_t{1} << 20), 1);
  at::set_num_threads(before);
}

// The kernels alone against LibTorch's operations, so that a fault in them
// cannot hide behind the reference path.
TEST(FusedOptim, AdamWKernelComputesAdamWsOperations) {
  torch::manual_seed(3);
  const int64_t n = 100003;  // several tasks and a remainder
  auto p = torch::randn({n}), g = torch::randn({n}), m = torch::randn({n}) * 0.1;
  auto v = torch::rand({n}) * 0.01, vmax = torch::rand({n}) * 0.01;
  const double lr = 1e-3, wd = 0.05, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  const int64_t step = 7;
  const double bc1 = 1 - std::pow(beta1, step), bc2 = 1 - std::pow(beta2, step);
  auto rp = p * (1 - lr * wd), rm = m * beta1 + g * (1 - beta1);
  auto rv = v * beta2 + g * g * (1 - beta2), rvmax = torch::max(vmax, rv);
  rp = rp - lr / bc1 * rm / (rvmax.sqrt() / std::sqrt(bc2) + eps);
  detail::AdamWCoefficients c;
  c.decay = true;
  c.decay_factor = static_cast<float>(1 - lr * wd);
  c.beta1 = 0.9F;
  c.one_minus_beta1 = static_cast<float>(1 - beta1);
  c.beta2 = 0.999F;
  c.one_minus_beta2 = static_cast<float>(1 - beta2);
  c.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-lr / bc1);
  detail::fused_adamw(p.data_ptr<float>(), g.data_ptr<float>(), at::kFloat, m.data_ptr<float>(),
                      v.data_ptr<float>(), vmax.data_ptr<float>(), nullptr, at::kFloat, n, c);
  EXPECT_TRUE(torch::allclose(m, rm, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(v, rv, 1e-6, 1e-9));
  EXPECT_TRUE(torch::equal(vmax, torch::max(vmax, v)));
  EXPECT_TRUE(torch::allclose(p, rp, 1e-6, 1e-6)) << (p - rp).abs().max().item<double>();
}

// A gradient kept in bf16 or float16 (MixedPrecision::keep_low_precision_grads:
// half the bytes from a GPU under CPU offload) steps exactly as its float32
// values do: bitwise, every step, with each group's options, the fused
// parameters and those on LibTorch's operations (the float64 one, the
// transposed one) alike.
template <typename MakeOptimizer>
void expect_low_precision_grads_step_as_float(const MakeOptimizer& make, at::ScalarType dtype) {
  auto low = make_params();
  auto full = copies(low);
  auto low_opt = make(low);
  auto full_opt = make(full);
  for (int step = 0; step < 20; ++step) {
    set_grads(low, full, step);
    for (size_t i = 0; i < low.size(); ++i) {
      if (!low[i].grad().defined() || low[i].scalar_type() != at::kFloat) continue;
      // The gradient rounded to `dtype` on one side, its float values on the other.
      at::Tensor rounded = full[i].grad().to(dtype);
      if (!low[i].is_contiguous()) rounded = full[i].grad().t().to(dtype).t();
      low[i].mutable_grad() = rounded;
      full[i].mutable_grad() = rounded.to(at::kFloat);
    }
    low_opt->step();
    full_opt->step();
    for (size_t i = 0; i < low.size(); ++i) {
      ASSERT_TRUE(torch::equal(low[i], full[i])) << dtype << " parameter " << i << " step " << step;
    }
  }
}

TEST(FusedOptim, LowPrecisionGradientsStepAsTheirFloatValues) {
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    expect_low_precision_grads_step_as_float(
        [](const std::vector<torch::Tensor>& params) {
          return std::make_unique<fsdp::optim::FusedAdamW>(groups(params, adamw_options()));
        },
        dtype);
    expect_low_precision_grads_step_as_float(
        [](const std::vector<torch::Tensor>& params) {
          return std::make_unique<fsdp::optim::FusedSGD>(groups(params, sgd_options()),
                                                         torch::optim::SGDOptions(0.1));
        },
        dtype);
  }
}

TEST(FusedOptim, StateSavedByOneLoadsIntoTheOther) {
  auto ours = make_params();
  auto theirs = copies(ours);
  fsdp::optim::FusedAdamW fused(groups(ours, adamw_options()));
  for (int step = 0; step < 5; ++step) {
    set_grads(ours, theirs, step);
    fused.step();
  }
  // `to` takes over `from`'s state (torch::save, torch::load) and
  // parameters; then both take ten steps alike, from `first`.
  const auto take_over = [&](torch::optim::Optimizer& from, std::vector<torch::Tensor>& from_params,
                             torch::optim::Optimizer& to, std::vector<torch::Tensor>& to_params,
                             int first) {
    for (size_t i = 0; i < to_params.size(); ++i)
      to_params[i].detach().copy_(from_params[i].detach());
    std::stringstream saved;
    torch::save(from, saved);
    torch::load(to, saved);
    for (int step = first; step < first + 10; ++step) {
      set_grads(ours, theirs, step);
      from.step();
      to.step();
    }
    expect_close(ours, theirs);
  };
  // The plain optimizer takes over the fused one's.
  torch::optim::AdamW reference(groups(theirs, adamw_options()));
  take_over(fused, ours, reference, theirs, 5);
  // And back: a fused optimizer takes over LibTorch's (a checkpoint of a run
  // that used torch::optim::AdamW).
  fsdp::optim::FusedAdamW resumed(groups(ours, adamw_options()));
  take_over(reference, theirs, resumed, ours, 15);
}

// The copy a GPU would compute with, written in the step's own pass: equal
// to Tensor::to() of the new values, for the kernel's parameters and the
// others alike.
TEST(FusedOptim, LowPrecisionCopiesAreTheNewValues) {
  auto params = make_params();
  auto unused = copies(params);
  fsdp::optim::FusedAdamW opt(groups(params, adamw_options()));
  const std::vector<std::pair<size_t, at::ScalarType>> wanted = {
      {0, at::kBFloat16}, {1, at::kHalf}, {2, at::kBFloat16}, {3, at::kBFloat16}};
  std::vector<torch::Tensor> low(params.size());
  for (const auto& [i, dtype] : wanted) {
    low[i] = torch::empty({params[i].numel()}, torch::dtype(dtype));
    opt.set_low_precision_copy(params[i], low[i]);
  }
  for (int step = 0; step < 5; ++step) {
    set_grads(params, unused, step);
    opt.step();
    for (const auto& [i, dtype] : wanted) {
      EXPECT_TRUE(torch::equal(low[i], params[i].detach().to(dtype).reshape({-1})))
          << "parameter " << i << ", step " << step;
    }
  }
  const std::string wrong =
      error_of([&] { opt.set_low_precision_copy(params[1], torch::empty({5}, torch::kBFloat16)); });
  EXPECT_NE(wrong.find("with the parameter's 2112 elements; got BFloat16 on cpu with 5"),
            std::string::npos)
      << wrong;
  const std::string stranger =
      error_of([&] { opt.set_low_precision_copy(torch::zeros({3}), torch::Tensor()); });
  EXPECT_NE(stranger.find("not a parameter of this optimizer"), std::string::npos) << stranger;
}

TEST(FusedOptim, SparseGradientsAreANamedError) {
  auto p = torch::zeros({4, 3}).requires_grad_();
  p.mutable_grad() = torch::eye(4, 3).to_sparse();
  fsdp::optim::FusedAdamW adamw({p});
  try {
    adamw.step();
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("FusedAdamW: sparse gradients are not supported"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace test_fused_optim
}  // namespace fsdp::testing
