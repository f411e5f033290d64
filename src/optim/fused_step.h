#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "core/sharded_placeholder.h"
#include "optim/backward_steps.h"

namespace fsdp::detail {

/// Whether `t` is what the fused kernels take: a contiguous, strided float32
/// CPU tensor of `numel` elements.
inline bool fused_layout(const at::Tensor& t, int64_t numel) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
         t.layout() == at::kStrided && t.numel() == numel;
}

/// Whether `grad` is a gradient the fused kernels take for a float32
/// parameter of `numel` elements: fused_layout's, in float32 or in a
/// low-precision dtype (bfloat16, float16: a gradient kept in the reduce
/// dtype, MixedPrecision::keep_low_precision_grads), read as its float values.
inline bool fused_grad_layout(const at::Tensor& grad, int64_t numel) {
  const at::ScalarType t = grad.scalar_type();
  return grad.device().is_cpu() && (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf) &&
         grad.is_contiguous() && grad.layout() == at::kStrided && grad.numel() == numel;
}

/// Where element `i` of contiguous `t` lies, whatever its dtype.
inline void* element_at(const at::Tensor& t, int64_t i) {
  return static_cast<char*>(t.data_ptr()) + i * static_cast<int64_t>(t.element_size());
}

/// `grad` in `param`'s dtype: what LibTorch's optimizer operations take for
/// a gradient kept in low precision, on the paths the kernels do not take.
inline at::Tensor grad_as_param(const at::Tensor& grad, const at::Tensor& param) {
  return grad.scalar_type() == param.scalar_type() ? grad : grad.to(param.scalar_type());
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
  // The kernels read memory, not through the dispatcher: an optimizer built
  // on the unwrapped module's parameters would read a placeholder's missing
  // data (a crash). Refused as torch::optim's are, before any step.
  const std::string user = std::string("fsdp::optim::") + name + "::step()";
  for (auto& group : groups) {
    for (auto& p : group.params()) {
      if (is_placeholder(p.grad())) refuse_placeholder_use(p.grad(), user);  // named first
      if (is_placeholder(p)) refuse_placeholder_use(p, user);
    }
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

/// The group of `groups` that holds `param` itself (the same tensor), or
/// nullptr.
inline const torch::optim::OptimizerParamGroup* group_of(
    const std::vector<torch::optim::OptimizerParamGroup>& groups, const at::Tensor& param) {
  for (const auto& group : groups) {
    for (const auto& p : group.params()) {
      if (p.is_same(param)) return &group;
    }
  }
  return nullptr;
}

/// step_each_parameter for an optimizer that may step during backward:
/// waits for `steps` (when set) and updates only what it did not step (Note
/// [Stepping beside backward]).
template <typename Options, typename Update>
torch::Tensor step_rest(std::vector<torch::optim::OptimizerParamGroup>& groups,
                        const torch::optim::Optimizer::LossClosure& closure, const char* name,
                        const std::shared_ptr<BackwardSteps>& steps, Update&& update) {
  std::unordered_set<const c10::TensorImpl*> done;
  if (steps) {
    TORCH_CHECK(closure == nullptr, "fsdp::optim::", name,
                "::step: no closure while stepping during backward (its backward would step "
                "again); call step() without one, or make a new optimizer");
    done = steps->take_stepped();
  }
  return step_each_parameter<Options>(groups, closure, name,
                                      [&](at::Tensor& p, const at::Tensor& grad, const Options& o) {
                                        if (done.count(p.unsafeGetTensorImpl()) == 0)
                                          update(p, grad, o);
                                      });
}

/// Waits for `steps`, if set, rethrowing its thread's error.
inline void wait_for(const std::shared_ptr<BackwardSteps>& steps) {
  if (steps) steps->wait();
}

/// Refuses torch::save/load of an optimizer stepping with `steps` (if set)
/// between a backward that stepped units and step().
inline void before_optimizer_state_use(const std::shared_ptr<BackwardSteps>& steps) {
  if (steps) steps->before_optimizer_state_use();
}

/// The BackwardSteps of an optimizer's step_during_backward(model), replacing
/// `current` (refused while its steps wait for step()): each handed-over
/// range of a parameter is updated by `update(param, grad, options, begin,
/// end)` with its group's options. A group whose options changed between
/// backward and step() is warned about at step(): its units stepped during
/// backward took them as they were.
template <typename Options, typename Update>
std::shared_ptr<BackwardSteps> attach_backward_steps(
    const std::shared_ptr<BackwardSteps>& current,
    std::vector<torch::optim::OptimizerParamGroup>& groups, const char* name,
    torch::nn::Module& model, Update update) {
  if (current) current->before_replaced();
  const std::string owner = std::string("fsdp::optim::") + name + "::step_during_backward";
  // Each group's options as the worker stepped with them, by group index
  // (written by the worker, read once it is idle).
  auto used = std::make_shared<std::map<size_t, Options>>();
  const auto check_options = [&groups, used, owner] {
    std::string changed;
    for (const auto& [index, options] : *used) {
      if (index < groups.size() &&
          !(static_cast<const Options&>(groups[index].options()) == options)) {
        changed += (changed.empty() ? "" : ", ") + std::to_string(index);
      }
    }
    // At each step it happens (a schedule set between backward and step() is
    // late at every step), once for all its groups.
    if (!changed.empty()) {
      TORCH_WARN(owner, ": the options of parameter group(s) ", changed,
                 " changed between backward and step(); the units stepped during backward "
                 "took them as they were, so the change reaches them from the next step "
                 "(change options before the forward, or step a scheduler after step(), to "
                 "apply them at once)");
    }
    used->clear();
  };
  auto steps = std::make_shared<BackwardSteps>(
      owner,
      [&groups, update, used](at::Tensor& param, int64_t begin, int64_t end) {
        const torch::optim::OptimizerParamGroup* group = group_of(groups, param);
        if (group != nullptr) {
          const auto& options = static_cast<const Options&>(group->options());
          used->emplace(static_cast<size_t>(group - groups.data()), options);
          update(param, param.grad(), options, begin, end);
        }
      },
      check_options);
  steps->attach(model);
  return steps;
}

}  // namespace fsdp::detail
