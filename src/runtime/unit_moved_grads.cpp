// What a unit does when the user clears the gradients its parameters show
// after a backward (Note [Gradients the user clears]).

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "core/sharded_placeholder.h"
#include "detail/error.h"
#include "runtime/norm_reduce.h"
#include "runtime/unit_runtime.h"

namespace fsdp::detail {

// Note [Gradients the user clears]
// After a backward each original parameter's .grad is its placeholder, the
// gradient itself in what the optimizer steps (the flat shard's .grad, or
// the use_orig_params pieces'). Users clear gradients three ways, and each
// must reach those tensors, or the next backward adds to the old gradient:
// - Module::zero_grad(set_to_none): per parameter, `grad = grad.detach()`
//   (a copy of the placeholder: the dispatch fallback sees it), then
//   grad.reset() or grad.zero_() on the copy. A slot's detach marks it
//   kDetached; a zero_ of its copy zeroes its part in place (kShown again).
//   When no shown slot is left, every one was detached and none zeroed:
//   zero_grad(true) (2.x's default) dropped them all, and the unit drops
//   its gradients then (memory is freed as in plain LibTorch). Only a unit
//   with one shown slot cannot tell zero_grad(false) from it there; the
//   zero_ that follows gets zeros back, with the options recorded.
// - The user's own loop, p.grad().zero_(): zeroes that parameter's part.
// - The user's own loop, p.mutable_grad().reset() (or = {}), and
//   zero_grad(true) on part of a unit: no operator tells. Before the next
//   backward adds anything (pre_backward, or its end for a unit it did not
//   reach) the unit finds the .grad it showed gone and drops that part (a
//   flat shard's part is zeroed; the whole shard's gradient is dropped when
//   no part is left). An optimizer step with no backward since still steps
//   what was dropped so.
// A gradient the user assigns in place of a placeholder counts as dropped:
// AccumulateGrad adds the next gradient to it, which the unit then reduces.
// Every slot that has a gradient after a backward shows its placeholder,
// one that got it only from other ranks too (show_moved_grads), so that
// loops testing p.grad().defined() reach it, as with plain LibTorch on the
// whole batch. A backward takes the placeholders off while it runs (its
// gradients must not meet one in AccumulateGrad) and puts back, at its end,
// those it took off: a slot this backward gave nothing (unused in this
// step, a backward with respect to the inputs only) still shows the
// gradient it keeps, and the next zero_grad reaches it.

c10::optional<size_t> UnitRuntime::slot_of_moved_grad(const at::Tensor& grad) const {
  const c10::StorageImpl* storage = grad.storage().unsafeGetStorageImpl();
  for (size_t i = 0; i < grad_placeholders_.size(); ++i) {
    if (grad_placeholders_[i].storage().unsafeGetStorageImpl() == storage) return i;
  }
  return c10::nullopt;
}

void UnitRuntime::moved_grad_detached(const at::Tensor& grad) {
  const auto slot = slot_of_moved_grad(grad);
  if (!slot || moved_grads_[*slot] != MovedGrad::kShown) return;
  ++grad_clears_;  // Note [Gathered before a step]
  moved_grads_[*slot] = MovedGrad::kDetached;
  if (std::find(moved_grads_.begin(), moved_grads_.end(), MovedGrad::kShown) !=
      moved_grads_.end()) {
    return;  // Module::zero_grad goes on to the others
  }
  wait_for_grad_users();
  // With use_orig_params only the detached slots' pieces: another piece
  // keeps what it has (a gradient hidden at this backward's start).
  const bool orig = options_.use_orig_params();
  dropped_grad_options_.assign(optim_params_.size(), c10::nullopt);
  const bool idle = state_ == Unit::TrainingState::kIdle ||
                    torch::autograd::get_current_graph_task_exec_info() == nullptr;
  for (size_t i = 0; i < optim_params_.size(); ++i) {
    if (orig && idle && moved_grads_[i] == MovedGrad::kDetached) {
      // What no_sync() or backwards within the node accumulated for the
      // piece goes with it, as zero_slot_grad drops it.
      if (i < slot_filled_.size()) slot_filled_[i] = false;
      forget_within_node_slot(i);
    }
    at::Tensor& g = optim_params_[i].mutable_grad();
    if (!g.defined() || (orig && moved_grads_[i] != MovedGrad::kDetached)) continue;
    dropped_grad_options_[i] = g.options();
    if (orig) g.reset();
  }
  if (!orig) clear_optim_grads(/*set_to_none=*/true);
  for (MovedGrad& m : moved_grads_) {
    if (m == MovedGrad::kDetached) m = MovedGrad::kDropped;
  }
}

void UnitRuntime::moved_grad_zeroed(const at::Tensor& grad) {
  const auto slot = slot_of_moved_grad(grad);
  if (!slot || moved_grads_[*slot] == MovedGrad::kNone) return;
  wait_for_grad_users();
  ++grad_clears_;  // Note [Gathered before a step]
  const size_t i = *slot;
  if (moved_grads_[i] != MovedGrad::kDropped) {
    zero_slot_grad(i);
    moved_grads_[i] = MovedGrad::kShown;
    return;
  }
  // Dropped with the others at its detach: zeros back, for the slot's piece,
  // or the flat shard's gradient (every dropped slot's part).
  const size_t owner = options_.use_orig_params() ? i : 0;
  at::Tensor& g = optim_params_[owner].mutable_grad();
  if (!g.defined() && owner < dropped_grad_options_.size() && dropped_grad_options_[owner]) {
    g = at::zeros(optim_params_[owner].sizes(), *dropped_grad_options_[owner]);
  }
  for (size_t j = 0; j < moved_grads_.size(); ++j) {
    if (moved_grads_[j] == MovedGrad::kDropped && (j == i || !options_.use_orig_params())) {
      moved_grads_[j] = MovedGrad::kShown;
    }
  }
}

// Note [LibTorch's clipping of a unit made in place]
// FSDP2's users clip with torch.nn.utils.clip_grad_norm_(model.parameters()),
// which works there because each .grad is a DTensor. LibTorch's own
// clip_grad_norm_ takes, for each parameter with a .grad, its norm
// (grad.data().norm(p)), stacks them, and multiplies each .grad in place by
// the clamped coefficient; clip_grad_value_ clamps each in place. The
// original parameters' .grads (a fully_shard model's parameters(), a
// wrapper's named_parameters()) are placeholders (Note [Gradients the user
// clears]), and the dispatch fallback hands both to the unit: the
// norm of a moved gradient is that of the whole gradient, every rank's part
// (each rank's ||part||_p^p summed over the job, a part held by r replicas
// counted 1 / r, or their maximum for the infinity norm: Unit::
// clip_grad_norm_'s reckoning, one parameter at a time), and an in-place
// elementwise operator with scalar arguments is applied to this rank's part.
// So LibTorch's function returns the global norm and every rank clips by it,
// as plain LibTorch on the whole batch does. The norm is collective (one
// small all-reduce per parameter): every rank must ask it, for the same
// parameters in the same order, as for any read of a sharded parameter;
// the root's clip_grad_norm_() does the same with one all-reduce. A
// gradient kept in parts on the ranks has no other reads: the infinity norm
// of LibTorch's clip (grad.abs().max()) is refused, naming the root's.

at::Tensor UnitRuntime::moved_grad_part(size_t i) const {
  if (options_.use_orig_params()) {
    const at::Tensor& g = optim_params_[i].grad();
    return g.defined() ? g.reshape({-1}) : g;
  }
  const at::Tensor& g = optim_params_[0].grad();
  if (!g.defined()) return g;
  const FlatParameter::ShardPart part = flat_->shard_part(i);
  return g.reshape({-1}).narrow(0, part.in_shard, part.numel);
}

void UnitRuntime::check_moved_grads_unstepped(const char* what) const {
  const ReducedGradHooks* hooks = grad_hooks();
  FSDP_CHECK(hooks == nullptr, -1, path_, what, " of a moved gradient: ", hooks ? hooks->owner : "",
             " steps each unit as soon as backward has reduced its gradient, so clipping after "
             "backward comes too late and would change gradients already stepped; turn that off "
             "to clip, or clip nothing");
}

at::Tensor UnitRuntime::moved_grad_norm(const at::Tensor& grad, double p) {
  const auto slot = slot_of_moved_grad(grad);
  TORCH_INTERNAL_ASSERT(slot.has_value(), "fsdp: a moved gradient's norm without its slot");
  check_moved_grads_unstepped("the norm");
  FSDP_CHECK(p >= 0, -1, path_, "the norm of order ", p,
             " of a moved gradient: expected a "
             "non-negative order (2, 1, INFINITY); a negative order's norm is no maximum or sum "
             "over the ranks' parts");
  wait_for_grad_users();
  // Unit::clip_grad_norm_'s reckoning, for one parameter.
  ProcessGroup* job = options_.process_group().get();
  const bool sharded = !flat_->keeps_unsharded() && job != nullptr;
  NormTerms terms(p);
  const at::Tensor part = moved_grad_part(*slot);
  if (part.defined() && part.numel() > 0) {
    terms.add(part, std::isinf(p) || !sharded ? 1.0 : 1.0 / replicas_of(job, flat_->group()));
  }
  double total = terms.value();
  if (sharded) total = std::isinf(p) ? all_norm_max(*job, total) : all_norm_sum(*job, total);
  return at::full({}, terms.root(total),
                  at::TensorOptions().dtype(grad.scalar_type()).device(grad.device()));
}

void UnitRuntime::write_moved_grad(const at::Tensor& grad,
                                   const std::function<void(const at::Tensor& part)>& write) {
  const auto slot = slot_of_moved_grad(grad);
  TORCH_INTERNAL_ASSERT(slot.has_value(), "fsdp: a moved gradient's write without its slot");
  check_moved_grads_unstepped("a write");
  wait_for_grad_users();
  write_slot_grad(*slot, write);
}

void UnitRuntime::zero_slot_grad(size_t i) {
  at::NoGradGuard no_grad;
  // What no_sync() accumulated for the slot goes too (Note [Filling the
  // flat gradient]: an unfilled slot is zeroed before the reduction).
  if (state_ == Unit::TrainingState::kIdle ||
      torch::autograd::get_current_graph_task_exec_info() == nullptr) {
    if (i < slot_filled_.size()) slot_filled_[i] = false;
    forget_within_node_slot(i);  // Note [Accumulating within the node]
  }
  write_slot_grad(i, [](const at::Tensor& part) { at::Tensor(part).zero_(); });
}

void UnitRuntime::write_slot_grad(size_t i,
                                  const std::function<void(const at::Tensor& part)>& write) {
  at::NoGradGuard no_grad;
  const at::Tensor part = moved_grad_part(i);
  if (!part.defined()) return;
  if (part.numel() > 0) {
    write(part);
  } else {
    // Nothing of it here; the gradient's version moves as on the ranks that
    // write their part (Note [Gathered before a step]).
    part.unsafeGetTensorImpl()->bump_version();
  }
}

void UnitRuntime::drop_grads_the_user_dropped() {
  if (!flat_) return;
  const auto& slots = flat_->slots();
  std::vector<bool> dropped(slots.size(), false);
  bool any = false;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (shows(moved_grads_[i]) && !is_placeholder(slots[i].param.grad())) dropped[i] = any = true;
  }
  if (!any) return;
  drop_slot_grads(dropped);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (dropped[i]) moved_grads_[i] = MovedGrad::kNone;
  }
}

void UnitRuntime::drop_slot_grads(const std::vector<bool>& dropped) {
  // Before this unit's backward adds anything (no optimizer is stepping
  // these now): what no_sync() accumulated for a dropped slot goes too.
  const auto& slots = flat_->slots();
  ++grad_clears_;  // Note [Gathered before a step]
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!dropped[i]) continue;
    if (i < slot_filled_.size()) slot_filled_[i] = false;
    forget_within_node_slot(i);  // Note [Accumulating within the node]
  }
  bool any_kept = false;
  for (size_t i = 0; i < slots.size(); ++i) {
    any_kept = any_kept || (shows(moved_grads_[i]) && !dropped[i]);
  }
  if (!options_.use_orig_params() && !any_kept) {
    clear_optim_grads(/*set_to_none=*/true);
    return;
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!dropped[i]) continue;
    if (options_.use_orig_params()) {
      optim_params_[i].mutable_grad().reset();
    } else {
      zero_slot_grad(i);
    }
  }
}

void UnitRuntime::show_moved_grads(bool reduced, const std::vector<bool>* received) {
  if (!flat_) return;
  const auto& slots = flat_->slots();
  for (size_t i = 0; i < slots.size(); ++i) {
    at::Tensor param = slots[i].param;
    const bool got = options_.use_orig_params()
                         ? optim_params_[i].requires_grad() && (!received || (*received)[i])
                         : param.requires_grad() && (!received || (*received)[0]);
    const bool hidden = moved_grads_[i] == MovedGrad::kHidden;
    if (hidden) moved_grads_[i] = MovedGrad::kNone;
    if (!hidden && !(reduced && got)) continue;
    if (!param.grad().defined()) param.mutable_grad() = grad_placeholders_[i];
    if (is_placeholder(param.grad())) moved_grads_[i] = MovedGrad::kShown;
  }
}

}  // namespace fsdp::detail
