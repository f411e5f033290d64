#include <fsdp/optim/fused.h>

#include <ATen/ATen.h>

#include <memory>

#include "detail/torch_compat.h"
#include "optim/fused_kernels.h"
#include "optim/fused_step.h"

// See Note [Fused host optimizers] in fused_kernels.h.

namespace fsdp::optim {

namespace {

using torch::optim::SGDOptions;
using torch::optim::SGDParamState;

// torch::optim::SGD's own operations, for the parameters the kernel does not
// take (other dtypes, devices or layouts).
void reference_step(at::Tensor& p, const at::Tensor& grad, SGDParamState* s, const SGDOptions& o) {
  at::Tensor d = grad;
  if (o.weight_decay() != 0) d = d.add(p, o.weight_decay());
  if (o.momentum() != 0) {
    at::Tensor& buf = s->momentum_buffer();
    if (!buf.defined()) {
      s->momentum_buffer(at::clone(d).detach());
    } else {
      buf.mul_(o.momentum()).add_(d, 1 - o.dampening());
    }
    d = o.nesterov() ? d.add(s->momentum_buffer(), o.momentum()) : s->momentum_buffer();
  }
  p.add_(d, -1 * o.lr());
}

}  // namespace

FusedSGD::~FusedSGD() {
  // Its thread steps what is still queued (a backward that threw) with this
  // optimizer's members: before any of them goes.
  backward_steps_.reset();
}

void FusedSGD::wait_for_steps() const { detail::wait_for(backward_steps_); }

void FusedSGD::save(torch::serialize::OutputArchive& archive) const {
  detail::before_optimizer_state_use(backward_steps_);
  torch::optim::SGD::save(archive);
}

void FusedSGD::load(torch::serialize::InputArchive& archive) {
  detail::before_optimizer_state_use(backward_steps_);
  torch::optim::SGD::load(archive);
}

torch::Tensor FusedSGD::step(LossClosure closure) {
  return detail::step_rest<SGDOptions>(
      param_groups_, closure, "FusedSGD", backward_steps_,
      [this](at::Tensor& p, const at::Tensor& grad, const SGDOptions& o) {
        step_param(p, grad, o, 0, p.numel());
      });
}

void FusedSGD::step_during_backward(torch::nn::Module& model) {
  backward_steps_ = detail::attach_backward_steps<SGDOptions>(
      backward_steps_, param_groups_, "FusedSGD", model,
      [this](at::Tensor& p, const at::Tensor& grad, const SGDOptions& o, int64_t begin,
             int64_t end) { step_param(p, grad, o, begin, end); });
}

bool FusedSGD::made_this_step(const at::Tensor& p, const SGDParamState& s) const {
  const auto it = fresh_buffers_.find(p.unsafeGetTensorImpl());
  return it != fresh_buffers_.end() && s.momentum_buffer().defined() &&
         it->second.lock().get() == s.momentum_buffer().unsafeGetTensorImpl();
}

void FusedSGD::step_param(at::Tensor& p, const at::Tensor& grad, const SGDOptions& o, int64_t begin,
                          int64_t end) {
  const int64_t n = p.numel();
  const bool whole = begin == 0 && end == n;
  SGDParamState* s = nullptr;
  bool first = false;
  bool made = false;  // the state entry, here
  const auto key = compat::optim_state_key(state_, p);
  if (o.momentum() != 0) {
    auto& slot = state_[key];
    if (!slot) {
      slot = std::make_unique<SGDParamState>();
      first = made = true;
    }
    s = static_cast<SGDParamState*>(slot.get());
    first = first || !s->momentum_buffer().defined();
    // A buffer made at this step's first range (Note [Stepping a gradient
    // as it lands]).
    if (begin != 0) first = made_this_step(p, *s);
  }
  const bool fused = detail::fused_layout(p, n) && detail::fused_grad_layout(grad, n) &&
                     (s == nullptr || first || detail::fused_layout(s->momentum_buffer(), n));
  if (!fused) {  // whole, at the parameter's last range
    if (end == n) {
      reference_step(p, detail::grad_as_param(grad, p), s, o);
    } else if (made) {
      // No entry without a buffer: a step that ends before the last range
      // (a backward that throws) would leave one for save() and step().
      state_.erase(key);
    }
    return;
  }
  // Still marked: the step that made its buffer failed midway (its later
  // ranges never came), so the buffer was never whole: made anew. Not when a
  // load has replaced it since.
  if (begin == 0 && s != nullptr && made_this_step(p, *s)) first = true;
  if (begin == 0) fresh_buffers_.erase(p.unsafeGetTensorImpl());
  if (first && begin == 0) {
    // In parts, zeros: a step that fails midway leaves no uninitialised
    // elements for a save before the next step.
    s->momentum_buffer(whole ? at::empty_like(p, at::MemoryFormat::Contiguous)
                             : at::zeros_like(p, at::MemoryFormat::Contiguous));
    if (!whole) {
      fresh_buffers_.emplace(p.unsafeGetTensorImpl(),
                             WeakBuffer(s->momentum_buffer().getIntrusivePtr()));
    }
  }
  if (end == n && begin != 0) fresh_buffers_.erase(p.unsafeGetTensorImpl());
  detail::SGDCoefficients c;
  c.weight_decay = static_cast<float>(o.weight_decay());
  c.momentum = static_cast<float>(o.momentum());
  c.one_minus_dampening = static_cast<float>(1 - o.dampening());
  c.neg_lr = static_cast<float>(-1 * o.lr());
  c.nesterov = o.nesterov();
  c.first = first;
  float* buf = s != nullptr ? s->momentum_buffer().data_ptr<float>() + begin : nullptr;
  detail::fused_sgd(p.data_ptr<float>() + begin, detail::element_at(grad, begin),
                    grad.scalar_type(), buf, end - begin, c);
  // Written through a pointer: the version counter moves as after an
  // in-place operation, so a host copy of the shard that FusedAdamW wrote
  // before is seen to be stale (Note [A host copy in the compute dtype]).
  p.unsafeGetTensorImpl()->bump_version();
}

}  // namespace fsdp::optim
