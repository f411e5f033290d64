#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/optimizer.h>

#include <vector>

namespace fsdp::detail {

/// Whether `t` is what the fused kernels take: a contiguous, strided float32
/// CPU tensor of `numel` elements.
inline bool fused_layout(const at::Tensor& t, int64_t numel) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
         t.layout() == at::kStrided && t.numel() == numel;
}

/// The frame of a torch::optim step: runs `closure` (if any) with gradients
/// on, then, without gradients, `update(param, grad, options)` for every
/// parameter of every group that has a dense gradient; returns the loss.
/// `name` ("FusedAdamW") is for the sparse-gradient error.
template <typename Options, typename Update>
torch::Tensor step_each_parameter(std::vector<torch::optim::OptimizerParamGroup>& groups,
                                  const torch::optim::Optimizer::LossClosure& closure,
                                  const char* name, Update&& update) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : groups) {
    const auto& options = static_cast<const Options&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(!p.grad().is_sparse(), "fsdp::optim::", name,
                  ": sparse gradients are not supported (nor by torch::optim's); use dense "
                  "gradients");
      update(p, p.grad(), options);
    }
  }
  return loss;
}

}  // namespace fsdp::detail
