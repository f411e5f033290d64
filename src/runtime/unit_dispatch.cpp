// detail::UnitRuntime and detail::RootState for units that fsdp::fully_shard
// made in place: their forward is learnt from the operators on their
// parameters. See Note [Units driven by dispatch].

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>

#include <utility>
#include <vector>

#include <fsdp/core/activation_checkpoint.h>

#include "detail/inference_mode.h"
#include "runtime/in_place_units.h"
#include "runtime/root_state.h"
#include "runtime/unit_runtime.h"

namespace fsdp::detail {

// Note [Units driven by dispatch]
// A module made a unit by fsdp::fully_shard keeps its class and its forward,
// and LibTorch modules have no forward hooks, so nothing calls pre_forward
// or post_forward. The unit learns of its forward from the operators on its
// parameters instead, through the dispatch key of Note [Sharded
// placeholders]: its placeholders, and while gathered its parameters'
// views of the unsharded buffer, carry that key, and the fallback reports
// each operator (not those inside it) to the unit, before and after it runs.
// - Before: a unit used while idle enters its forward, as a wrapper's
//   pre_forward (the root's order bookkeeping, gather, forward prefetch),
//   after the idle units around it, outermost first (the root first). Units
//   still in forward that do not hold it are done: their forward ends (the
//   wrapper's post_forward: reshard under FULL_SHARD, join the reduction
//   order). So in FULL_SHARD at most the units on one path from the root
//   hold gathered parameters, plus one prefetched.
// - After: in a grad-mode forward, each output that needs a gradient gets the
//   pre-backward hook, exactly where backward will need the parameters. The
//   first such hook to fire ends the forward of every unit still in it; the
//   unit whose hook fired keeps its parameters (backward needs them first).
// - The end of a forward is not seen. A forward that no backward follows
//   ends when the first unit it entered after the root is entered again (the
//   next forward: a model whose first unit runs twice per forward has its
//   forward order recorded and checked per half), or when the unit must be
//   idle for something else (SummonFullParams, a state dict), or at the end
//   of the next backward.
// - In backward, a sharded parameter that an operator reaches (a unit whose
//   outputs were not hooked, an activation-checkpointed recomputation) is
//   gathered there, as pre-backward gathers.
// - Any other use of a sharded parameter, outside a forward, gathers its
//   unit like a forward would: collective, so every rank must do it.
// - Mixed precision: no forward inputs to cast, so an operator on a
//   low-precision unit's parameters gets its other floating-point inputs
//   cast to their dtype (compute_dtype); activations then flow in it, as
//   after a wrapper's input cast. Backward casts nothing: its operators'
//   inputs have the dtypes forward gave them.
// - Module::zero_grad() on the model reaches each moved gradient (it
//   detaches every .grad): the unit clears its shards' gradients too (Note
//   [Gradients the user clears]). So the moved gradients stay until
//   pre_backward, not only until the next forward (a forward that no
//   backward follows would otherwise drop them first).
// - An operator that writes to a unit's parameters in place (an
//   initialiser after fully_shard, a clamp_ under no_grad) writes each
//   rank's part of the gathered parameters back into its shard, so the
//   change lasts as in plain LibTorch (and FSDP2, whose sharded parameters
//   take such writes); under mixed precision only those it wrote, which
//   take the compute dtype's rounding, the others keep their shards.
// - An operator on several units' parameters (torch::cat of two blocks'
//   weights, parameters_to_vector) holds them all gathered until it ran,
//   though entering one ends another's forward.
// - SummonFullParams and the state dicts read and write under
//   UnreportedUses: the user's use of full parameters is no forward.
// Cost: one boxed call per top-level operator on a unit's parameters and
// one hook per output; bench_overhead --in-place measures it (1.02-1.08x a
// wrapper's per-unit cost), bench/fully_shard_step.sh the GPT-mini step.

void UnitRuntime::hold_for_operator() {
  TORCH_INTERNAL_ASSERT(operator_hold_ == OperatorHold::kNone, "fsdp: ", label(),
                        " held for two operators at once");
  operator_hold_ = OperatorHold::kHeld;
}

void UnitRuntime::before_param_use(bool sharded) {
  const OutsideInferenceMode outside;  // See Note [Inference mode].
  if (checkpoint_phase() == CheckpointPhase::kRecompute) {
    // Whatever the operator saw: a prefetch still arriving (kUnsharding)
    // has its storage, so it looks gathered, and must be waited for. A
    // checkpointed unit read NaN from such a buffer, now and then.
    if (flat_) unshard();
    return;
  }
  // A backward through a graph that a backward with create_graph built reads
  // parameters it saved before any output hook runs (Note [Double backward]).
  const bool backward_runs = torch::autograd::get_current_graph_task_exec_info() != nullptr;
  // Note [A model's units outlive it]: outside any iteration of the gone
  // root (whose backward may still call it), its units are orphaned now and
  // freed once this operator ended (it may use some of them).
  if (root_ != nullptr && root_ != owned_root_.get() && root_->module_gone() && !backward_runs &&
      !root_->in_iteration()) {
    root_->orphan_units();
    after_this_operator(&release_gone_in_place_units);
  }
  if (root_ == nullptr) become_rooted();
  RootState& r = root();
  if (r.keeps_graph() && backward_runs) r.queue_end_of_backward();
  // A backward that threw leaves the root in backward (autograd drops its
  // end callback): an operator outside any backward is the next forward.
  if (r.in_backward() && backward_runs) {
    // Its outputs' hook ran pre_backward, or backward reached it without one
    // (a custom autograd Function's saved parameters: its forward ran
    // without grad mode, so no output of theirs was hooked). Gathered, and
    // a prefetch under way waited for, before the operator reads it.
    // pre_backward skips the gather where the user said backward does not
    // read the unit's parameters (Note [Units backward does not gather]):
    // this operator reads them.
    if (state_ == Unit::TrainingState::kIdle) pre_backward();
    if (flat_) unshard();  // resharded after its reduction, or still arriving
    return;
  }
  if (state_ == Unit::TrainingState::kForward) {
    if (!gathered_may_be_stale()) {
      // Sharded, or (its views look gathered) a gather still arriving: the
      // user's unshard(async_op) after a reshard() in its forward.
      if (sharded || flat_->state() == FlatParameter::State::kUnsharding) unshard();
      return;
    }
    // A step (or the clearing of gradients before the next) came since a
    // forward that no backward followed gathered it: this is the next
    // forward (Note [Gathered before a step]).
    r.settle_forward(nullptr);
  }
  refuse_shards_as_checkpoint_params();
  r.enter_forward(*this);
}

void UnitRuntime::param_use_arguments(c10::ArrayRef<c10::IValue> args) {
  // See Note [Parameters backward reads without a gradient]: a unit made in
  // place has no forward arguments to hook; the arguments that need a
  // gradient of each operator on its parameters are what its backward's
  // reads wait for (each such node runs before their gradients are complete).
  if (state_ != Unit::TrainingState::kForward || !has_frozen_reads()) return;
  // A checkpointed region reads the parameters again in its recomputation,
  // inside backward: those reads are not counted (the end of backward).
  if (checkpoint_phase() != CheckpointPhase::kNone) return record_forward_inputs({}, false);
  if (!at::GradMode::is_enabled()) return;  // no node of the graph reads them
  std::vector<at::Tensor> inputs;
  bool all_found = true;
  const at::Tensor& buffer = flat_->unsharded();
  for_each_tensor(args, [&](const at::Tensor& t) {
    if (!t.defined() || !t.requires_grad()) return;
    if (!is_placeholder(t)) {
      inputs.push_back(t);
    } else if (!t.has_storage() ||
               t.storage().unsafeGetStorageImpl() != buffer.storage().unsafeGetStorageImpl()) {
      all_found = false;  // another unit's parameter: its node's reads are not counted
    }
  });
  record_forward_inputs(inputs, all_found);
}

void UnitRuntime::after_param_use(c10::ArrayRef<c10::IValue> outputs, bool wrote) {
  const OutsideInferenceMode outside;  // See Note [Inference mode].
  const bool reshard_now =
      std::exchange(operator_hold_, OperatorHold::kNone) == OperatorHold::kReshardAfter;
  // A write in place (an initialiser after fully_shard, a clamp_ under
  // no_grad) lasts, as in plain LibTorch: each rank keeps its part of the
  // gathered parameters it changed (in the compute dtype under mixed
  // precision).
  if (wrote && flat_ && flat_->frees_unsharded() &&
      flat_->state() == FlatParameter::State::kUnsharded) {
    write_back(outputs);
  }
  // Its forward ended while the operator read it, and it was not entered
  // again since.
  if (reshard_now && state_ == Unit::TrainingState::kIdle) reshard();
  if (state_ != Unit::TrainingState::kForward || !at::GradMode::is_enabled()) return;
  for_each_tensor(outputs, [this](const at::Tensor& t) {
    if (hook_output(t)) hooked_ = true;
  });
}

void UnitRuntime::write_back(c10::ArrayRef<c10::IValue> outputs) {
  // Under mixed precision the gathered parameters are param_dtype copies:
  // only the parameters the operator wrote (its outputs, in place) are
  // written back, so that the others keep their full-precision shards. An
  // output that is no view of the buffer leaves the whole shard to copy.
  if (!flat_->low_precision()) return flat_->copy_unsharded_into_shard();
  const at::Tensor& buffer = flat_->unsharded();
  std::vector<std::pair<int64_t, int64_t>> written;
  bool known = true;
  for_each_tensor(outputs, [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage() ||
        t.storage().unsafeGetStorageImpl() != buffer.storage().unsafeGetStorageImpl()) {
      known = false;
      return;
    }
    int64_t extent = 1;
    for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
    const int64_t begin = t.storage_offset() - buffer.storage_offset();
    written.emplace_back(begin, begin + (t.numel() == 0 ? 0 : extent));
  });
  if (!known || written.empty()) return flat_->copy_unsharded_into_shard();
  for (const FlatParamSlot& slot : flat_->slots()) {
    for (const auto& [begin, end] : written) {
      if (begin < slot.offset + slot.numel && slot.offset < end) {
        flat_->copy_unsharded_into_shard(slot.offset, slot.offset + slot.numel);
        break;
      }
    }
  }
}

c10::optional<at::ScalarType> UnitRuntime::compute_dtype() const {
  // A wrapper casts its inputs (the root's, or every unit's with
  // cast_forward_inputs); without a forward to cast at, every operator on a
  // low-precision unit's parameters computes in their dtype, and one on a
  // unit kept in full precision in its own (Note [Units driven by dispatch]).
  // Only forwards cast (a recomputation for activation checkpointing is one):
  // a backward's operators get what forward gave them, saved statistics in
  // float32 beside a float16 weight included (CUDA's layer_norm_backward
  // refuses its mean and rstd cast), as FSDP2 casts nothing there.
  if (root_ != nullptr && root_->in_backward() &&
      checkpoint_phase() != CheckpointPhase::kRecompute) {
    return c10::nullopt;
  }
  if (flat_ && (flat_->low_precision() || full_precision_override_)) return flat_->param_dtype();
  return c10::nullopt;
}

bool UnitRuntime::holds_buffer(const at::Tensor& t) const {
  if (!buffers_listed_) {
    buffers_listed_.emplace();
    if (self_ != nullptr) {
      buffers_listed_->held = self_->buffers();
      for (const at::Tensor& b : buffers_listed_->held) {
        buffers_listed_->impls.insert(b.unsafeGetTensorImpl());
      }
    }
  }
  return buffers_listed_->impls.count(t.unsafeGetTensorImpl()) != 0;
}

void UnitRuntime::orphan() {
  root_ = nullptr;
  enclosing_ = nullptr;
  if (state_ != Unit::TrainingState::kIdle) abandon_iteration();
}

void UnitRuntime::become_rooted() {
  UnitRuntime* top = outermost_in_place_unit(*self_);
  TORCH_INTERNAL_ASSERT(top != nullptr && top->root_ == nullptr,
                        "fsdp: a unit made in place has no root");
  top->owned_root_ = std::make_unique<RootState>(*top);
}

void UnitRuntime::end_dispatched_forward(bool keep) {
  if (is_root()) root().exec_order().end_forward();
  transition(Unit::TrainingState::kIdle);
  if (is_root()) root().release_held(/*keep_newest=*/false);
  if (flat_ && !keep && frees_after_forward(/*backward_follows=*/hooked_)) {
    if (operator_hold_ == OperatorHold::kNone) {
      reshard();
    } else {
      operator_hold_ = OperatorHold::kReshardAfter;  // the operator reads it still
    }
  }
  if (hooked_ && flat_ && trainable_slots_ > 0) root().join_reduction_order(*this);
  hooked_ = false;
}

void UnitRuntime::end_open_forward() {
  if (root_ != nullptr && root_->forward_in_progress()) root_->settle_forward(nullptr);
}

void RootState::enter_forward(UnitRuntime& unit) {
  if (&unit == first_entered_) settle_forward(nullptr);  // the next forward
  // The idle units from `unit` out to the first one in forward.
  std::vector<UnitRuntime*> chain;
  for (UnitRuntime* u = &unit; u != nullptr && u->state_ != Unit::TrainingState::kForward;
       u = u->enclosing_) {
    chain.push_back(u);
  }
  UnitRuntime* around = chain.back()->enclosing_;
  while (!forward_units_.empty() && forward_units_.back() != around) {
    UnitRuntime* done = forward_units_.back();
    forward_units_.pop_back();
    done->end_dispatched_forward(/*keep=*/false);
  }
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    UnitRuntime* u = *it;
    if (u == &root_) first_entered_ = nullptr;
    forward_units_.push_back(u);
    u->begin_forward_state();
    if (first_entered_ == nullptr && u != &root_) first_entered_ = u;
  }
}

void RootState::settle_forward(UnitRuntime* keep) {
  while (!forward_units_.empty()) {
    UnitRuntime* done = forward_units_.back();
    forward_units_.pop_back();
    done->end_dispatched_forward(done == keep);
  }
  first_entered_ = nullptr;
}

}  // namespace fsdp::detail
