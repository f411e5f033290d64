#include <fsdp/optim/fused.h>

#include <fsdp/runtime/compute_copies.h>

#include <ATen/ATen.h>

#include <cmath>
#include <memory>
#include <tuple>

#include "detail/torch_compat.h"
#include "optim/fused_kernels.h"
#include "optim/fused_step.h"

// See Note [Fused host optimizers] in fused_kernels.h.

namespace fsdp::optim {

namespace {

using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;

// Whether every tensor of the step is a contiguous float32 CPU tensor of the
// parameter's size (the gradient may be bfloat16 or float16): the fused
// kernel's case.
bool fusable(const at::Tensor& p, const at::Tensor& grad, const AdamWParamState& s) {
  const int64_t n = p.numel();
  return detail::fused_layout(p, n) && detail::fused_grad_layout(grad, n) &&
         detail::fused_layout(s.exp_avg(), n) && detail::fused_layout(s.exp_avg_sq(), n) &&
         (!s.max_exp_avg_sq().defined() || detail::fused_layout(s.max_exp_avg_sq(), n));
}

// torch::optim::AdamW's own operations, for the parameters the kernel does
// not take (other dtypes, devices or layouts).
void reference_step(at::Tensor& p, const at::Tensor& grad, AdamWParamState& s,
                    const AdamWOptions& o, double bias_correction1, double bias_correction2) {
  const double beta1 = std::get<0>(o.betas());
  const double beta2 = std::get<1>(o.betas());
  s.exp_avg().mul_(beta1).add_(grad, 1 - beta1);
  s.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  at::Tensor denom;
  if (o.amsgrad()) {
    at::max_out(s.max_exp_avg_sq(), s.exp_avg_sq(), s.max_exp_avg_sq());
    denom = (s.max_exp_avg_sq().sqrt() / std::sqrt(bias_correction2)).add_(o.eps());
  } else {
    denom = (s.exp_avg_sq().sqrt() / std::sqrt(bias_correction2)).add_(o.eps());
  }
  p.addcdiv_(s.exp_avg(), denom, -o.lr() / bias_correction1);
}

}  // namespace

FusedAdamW::~FusedAdamW() {
  // Its thread steps what is still queued (a backward that threw) with this
  // optimizer's members: before any of them goes.
  backward_steps_.reset();
}

void FusedAdamW::wait_for_steps() const { detail::wait_for(backward_steps_); }

void FusedAdamW::save(torch::serialize::OutputArchive& archive) const {
  detail::before_optimizer_state_use(backward_steps_);
  torch::optim::AdamW::save(archive);
}

void FusedAdamW::load(torch::serialize::InputArchive& archive) {
  detail::before_optimizer_state_use(backward_steps_);
  torch::optim::AdamW::load(archive);
}

torch::Tensor FusedAdamW::step(LossClosure closure) {
  return detail::step_rest<AdamWOptions>(
      param_groups_, closure, "FusedAdamW", backward_steps_,
      [this](at::Tensor& p, const at::Tensor& grad, const AdamWOptions& o) {
        step_param(p, grad, o, 0, p.numel());
      });
}

void FusedAdamW::step_during_backward(torch::nn::Module& model) {
  backward_steps_ = detail::attach_backward_steps<AdamWOptions>(
      backward_steps_, param_groups_, "FusedAdamW", model,
      [this](at::Tensor& p, const at::Tensor& grad, const AdamWOptions& o, int64_t begin,
             int64_t end) { step_param(p, grad, o, begin, end); });
}

void FusedAdamW::step_param(at::Tensor& p, const at::Tensor& grad, const AdamWOptions& o,
                            int64_t begin, int64_t end) {
  const int64_t n = p.numel();
  const auto key = compat::optim_state_key(state_, p);
  // Note [Stepping a gradient as it lands]: a range of the parameter where
  // the fused kernel takes it (the state made and the step counted at its
  // first range), else the whole parameter at its last range. Looked up,
  // not made, until it steps: an empty entry left by a range that does not
  // step (a backward that throws before the last) would crash save().
  if (begin != 0 || end != n) {
    const auto found = state_.find(key);
    const bool ranged = detail::fused_layout(p, n) && detail::fused_grad_layout(grad, n) &&
                        (found == state_.end() || !found->second ||
                         fusable(p, grad, static_cast<AdamWParamState&>(*found->second)));
    if (!ranged) {
      if (end == n) step_param(p, grad, o, 0, n);
      return;
    }
  }
  auto& slot = state_[key];
  if (!slot) {
    auto fresh = std::make_unique<AdamWParamState>();
    fresh->step(0);
    fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (o.amsgrad()) fresh->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    slot = std::move(fresh);
  }
  auto& s = static_cast<AdamWParamState&>(*slot);
  if (begin == 0) s.step(s.step() + 1);
  const double beta1 = std::get<0>(o.betas());
  const double beta2 = std::get<1>(o.betas());
  const double bias_correction1 = 1 - std::pow(beta1, s.step());
  const double bias_correction2 = 1 - std::pow(beta2, s.step());
  const auto copy_it = low_precision_copies_.find(p.unsafeGetTensorImpl());
  const at::Tensor* copy = copy_it != low_precision_copies_.end() ? &copy_it->second : nullptr;
  if (!fusable(p, grad, s)) {  // whole: a range is fusable
    if (o.weight_decay() != 0) p.mul_(1 - o.lr() * o.weight_decay());
    reference_step(p, detail::grad_as_param(grad, p), s, o, bias_correction1, bias_correction2);
    if (copy != nullptr) copy->view(p.sizes()).copy_(p);
    return;
  }
  detail::AdamWCoefficients c;
  c.decay = o.weight_decay() != 0;
  c.decay_factor = static_cast<float>(1 - o.lr() * o.weight_decay());
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1 - beta2);
  c.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bias_correction2));
  c.eps = static_cast<float>(o.eps());
  c.neg_step_size = static_cast<float>(-o.lr() / bias_correction1);
  float* vmax = o.amsgrad() ? s.max_exp_avg_sq().data_ptr<float>() + begin : nullptr;
  void* copy_at = copy != nullptr ? detail::element_at(*copy, begin) : nullptr;
  detail::fused_adamw(p.data_ptr<float>() + begin, detail::element_at(grad, begin),
                      grad.scalar_type(), s.exp_avg().data_ptr<float>() + begin,
                      s.exp_avg_sq().data_ptr<float>() + begin, vmax, copy_at,
                      copy != nullptr ? copy->scalar_type() : at::kFloat, end - begin, c);
  // Written through pointers: the version counters move as after in-place
  // operations (Note [A host copy in the compute dtype]).
  p.unsafeGetTensorImpl()->bump_version();
  if (copy != nullptr) copy->unsafeGetTensorImpl()->bump_version();
}

void FusedAdamW::write_compute_copies(torch::nn::Module& model) {
  wait_for_steps();  // its thread reads the copies
  for (auto& [param, copy] : offloaded_compute_copies(model)) {
    if (detail::group_of(param_groups_, param) != nullptr) set_low_precision_copy(param, copy);
  }
}

void FusedAdamW::set_low_precision_copy(const torch::Tensor& param, torch::Tensor copy) {
  wait_for_steps();
  TORCH_CHECK(detail::group_of(param_groups_, param) != nullptr,
              "fsdp::optim::FusedAdamW::set_low_precision_copy: the tensor is not a parameter "
              "of this optimizer; pass one of the tensors it was made with");
  if (!copy.defined()) {
    low_precision_copies_.erase(param.unsafeGetTensorImpl());
    return;
  }
  TORCH_CHECK((copy.scalar_type() == at::kBFloat16 || copy.scalar_type() == at::kHalf) &&
                  copy.device().is_cpu() && copy.is_contiguous() && copy.numel() == param.numel(),
              "fsdp::optim::FusedAdamW::set_low_precision_copy: the copy must be a contiguous CPU "
              "tensor of bfloat16 or float16 with the parameter's ",
              param.numel(), " elements; got ", copy.scalar_type(), " on ", copy.device(), " with ",
              copy.numel(), " elements", copy.is_contiguous() ? "" : ", not contiguous");
  low_precision_copies_[param.unsafeGetTensorImpl()] = std::move(copy);
}

}  // namespace fsdp::optim
