// detail::UnitRuntime's forward and backward hooks: the unit's TrainingState
// machine (see Note [FSDP and autograd] and Note [Unit, runtime and root]).

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

#include <fsdp/core/activation_checkpoint.h>

#include "comm/work_state.h"
#include "core/checkpoint_region.h"
#include "core/copy_in_ahead.h"
#include "core/device_storage.h"
#include "core/device_streams.h"
#include "core/sharded_placeholder.h"
#include "detail/env.h"
#include "detail/error.h"
#include "detail/inference_mode.h"
#include "detail/torch_compat.h"
#include "runtime/exec_order.h"
#include "runtime/reduced_grad.h"
#include "runtime/root_state.h"
#include "runtime/unit_collectives.h"
#include "runtime/unit_runtime.h"

// A profiler label naming the unit by its module path, built only while a
// profiler listens: "fsdp::all_gather (blocks.0)".
#define FSDP_RECORD(what, path)                             \
  RECORD_USER_SCOPE(std::string("fsdp::") + (what) + " (" + \
                    ((path).empty() ? std::string("root") : std::string(path)) + ")")

namespace fsdp::detail {

using State = Unit::TrainingState;

// The transitions of one iteration; anything else is a bug in libfsdp.
void UnitRuntime::transition(State to) {
  const State from = state_;
  const bool allowed = (from == State::kIdle && to == State::kForward) ||
                       (from == State::kForward && to == State::kIdle) ||
                       (from == State::kIdle && to == State::kPreBackward) ||
                       (from == State::kPreBackward && to == State::kPostBackward) ||
                       (from == State::kPreBackward && to == State::kIdle) ||
                       (from == State::kPostBackward && to == State::kIdle);
  TORCH_INTERNAL_ASSERT(allowed, "fsdp: ", label(), " cannot go from ", to_string(from), " to ",
                        to_string(to));
  state_ = to;
}

// A forward began while the last iteration was unfinished: its forward threw,
// or its backward never ran (evaluation after training without backward) or
// stopped part-way. Nothing of it completes: the state returns to idle, this
// backward's arrival count restarts and a reduction it launched is dropped
// (RootState::begin_forward). Gradients already moved into the flat buffer
// stay, as a partial backward leaves .grad in plain LibTorch.
void UnitRuntime::abandon_iteration() {
  TORCH_INTERNAL_ASSERT(state_ != State::kIdle);
  // A backward began here and threw: what it left unreduced is invisible to
  // the optimizer's zero_grad(), unlike the .grad plain LibTorch leaves.
  if (flat_grad_.defined() && state_ != State::kForward &&
      (root_ == nullptr || !root_->keeps_graph())) {
    TORCH_WARN_ONCE(path_, ": a backward stopped midway (it threw) and left gradients of ", label(),
                    " not yet reduced; the next backward adds to them, as plain LibTorch adds "
                    "to the .grad such a backward leaves, but the optimizer's zero_grad() does "
                    "not reach them: call model->zero_grad() after a backward that throws to "
                    "discard them");
  }
  state_ = State::kIdle;
  reset_backward_progress();
  delivered_early_ = false;
  grad_work_ = Work();
  // What was kept within the node stays for the next backward, unless a
  // reduction that crossed the nodes took it (it is dropped with it).
  if (!kept_within_node_) within_node_filled_.clear();
  grad_reach_ = GradReach::kJob;
  if (copy_out_ == CopyOut::kQueued) {  // not while the copy-out stream writes grad_shard_
    release_copied_out(/*wait=*/true);
    wait_for_side_stream(flat_->unsharded().device(), SideStream::kCopyOut);
    copy_out_ = CopyOut::kNone;
  }
  grad_shard_ = at::Tensor();
}

void UnitRuntime::reset_backward_progress() {
  grads_ready_ = 0;
  grads_expected_ = trainable_slots_;
  frozen_reads_ = FrozenReads::kNone;
  backward_gather_ = BackwardGather::kNone;
  forget_forward_inputs();
}

void UnitRuntime::unshard_async(bool prefetch) {
  // See Note [Copy-in on a stream of its own].
  const bool in_iteration = root_ != nullptr && root_->in_iteration();
  if (in_iteration) root_->release_held(/*keep_newest=*/!prefetch);
  pending_gather_ = all_gather_unit(*flat_, /*copy_in_waits_for_current=*/!in_iteration);
  mark_gather();
}

void UnitRuntime::wait_pending_gather() {
  if (flat_->state() != FlatParameter::State::kUnsharding) return;
  wait_all_gather(*flat_, std::exchange(pending_gather_, Work()));
}

void UnitRuntime::unshard() {
  if (flat_->state() == FlatParameter::State::kUnsharded) return;  // never freed, or already
  // See Note [Units backward does not gather]: the agreement on uneven
  // backwards asks a unit that was told not to whether it did.
  if (root_ != nullptr && root_->in_backward()) backward_gather_ = BackwardGather::kGathered;
  FSDP_RECORD("all_gather", path_);
  if (flat_->state() == FlatParameter::State::kSharded) unshard_async(/*prefetch=*/false);
  wait_pending_gather();
}

void UnitRuntime::reshard() {
  if (!flat_->frees_unsharded() || flat_->state() == FlatParameter::State::kSharded) return;
  if (held_for_graph()) return;  // Note [Double backward]
  // See Note [Parameters backward reads without a gradient].
  if (frozen_reads_ == FrozenReads::kPending) return;
  free_unsharded();
}

// Note [Resharding as the user says]
// FSDP2's knobs over when a unit frees its gathered parameters, beside what
// its strategy decides:
// - set_reshard_after_forward(b) replaces the strategy's choice at the end of
//   a forward (FULL_SHARD frees, SHARD_GRAD_OP keeps for backward, the root
//   keeps its own, a forward without grad mode frees): false keeps the unit
//   gathered after every forward (an evaluation loop gathers once), true
//   frees the root's too. The first unit of backward still stays gathered
//   until the next unit's forward begins (Note [The first unit of backward
//   stays gathered]): what FSDP frees there it regathers at once.
// - set_reshard_after_backward(false) keeps the unit gathered where backward
//   frees it (its reduction launched, its frozen reads over, the end of
//   backward), so that the next forward gathers nothing: gradient
//   accumulation under set_requires_gradient_sync(false) saves one
//   all-gather per unit and micro-batch (FULL_SHARD's backward gather
//   stays).
// - unshard() starts the gather the unit's next forward would make, so that
//   it overlaps what runs before (a prefetch the user schedules, from inside
//   an enclosing forward too); the forward waits for it and then frees as it
//   would have. reshard() frees what any of these left gathered.
// What is kept gathered this way is "left gathered" as an evaluation's
// forward leaves it: the next forward gathers it anew where a step, a load
// or a clearing of gradients may have made it stale (Note [Gathered before a
// step]), where FSDP2 computes with the stale values, and torch::save
// gathers anew whatever is gathered. One case has no sign: LibTorch's SGD
// steps through .data(), which moves no version counter, and a loop that
// clears gradients between forward and backward leaves none either. So
// set_reshard_after_backward(false) keeps a unit only through backwards
// that do not synchronise gradients (no_sync(), set_requires_gradient_sync
// (false): gradient accumulation, what FSDP2 documents it for), never
// through one that a step follows (also no optimizer steps during it, Note
// [Steps during backward]). unshard() is for after the step. The ranks must
// call them alike (the gathers they decide are collective), as in FSDP2.
bool UnitRuntime::frees_after_forward(bool backward_follows) const {
  if (reshard_after_forward_) return *reshard_after_forward_;
  return !backward_follows || (!is_root() && reshards_after_forward(options_.sharding_strategy()));
}

void UnitRuntime::reshard_in_backward() {
  // Kept only through a backward that does not synchronise: one that does
  // is followed by a step (Note [Resharding as the user says]).
  if (reshard_after_backward_ || require_sync()) reshard();
}

void UnitRuntime::check_user_resharding(const char* what) const {
  FSDP_CHECK(
      (!flat_ || flat_->state() != FlatParameter::State::kSummoned) && !held_by_summon_guard(),
      flat_ ? flat_->group().rank() : -1, path_, what, "() on ", label(),
      " inside SummonFullParams: the guard holds its parameters until it ends. Call it "
      "after the guard");
}

uint64_t UnitRuntime::unshard_for_user(bool async_op) {
  const OutsideInferenceMode outside;  // See Note [Inference mode].
  check_user_resharding("unshard");
  // In its backward, or a checkpointed forward's recomputation there, the
  // unit gathers what it needs itself: a prefetch hint is moot.
  if (!flat_ || !flat_->frees_unsharded() || checkpoint_phase() == CheckpointPhase::kRecompute ||
      (state_ != State::kIdle && state_ != State::kForward)) {
    return gathers_;
  }
  if (root_ == nullptr || !root_->in_iteration())
    before_state_use();  // Note [Steps during backward]
  // A forward's gather would replace values a step made stale (Note
  // [Gathered before a step]): so does this one, ahead of it.
  if (state_ == State::kIdle && flat_->state() != FlatParameter::State::kSharded &&
      gathered_may_be_stale()) {
    reshard();
  }
  if (flat_->state() == FlatParameter::State::kSharded) {
    FSDP_RECORD("all_gather", path_);
    unshard_async(/*prefetch=*/true);
  }
  if (!async_op) wait_pending_gather();
  return gathers_;
}

void UnitRuntime::wait_for_user_gather(uint64_t gather) {
  const OutsideInferenceMode outside;  // See Note [Inference mode].
  // A later gather, or the forward that waited for this one, took it over.
  if (flat_ && gather == gathers_) wait_pending_gather();
}

void UnitRuntime::reshard_for_user() {
  // A unit fully_shard made gathers again at the next operator on its
  // parameters, and before its backward, as FULL_SHARD's do: it may be
  // freed in its forward, outside an operator. A wrapper's forward reads
  // them directly.
  check_user_resharding("reshard");
  FSDP_CHECK(state_ == State::kIdle || (state_ == State::kForward && driver_ == Driver::kDispatch &&
                                        operator_hold_ == OperatorHold::kNone),
             flat_ ? flat_->group().rank() : -1, path_, "reshard() on ", label(), " in its ",
             to_string(state_), " state: its ", state_ == State::kForward ? "forward" : "backward",
             " reads the gathered parameters. Call it outside the unit's forward and backward "
             "(after backward, or before the next forward)");
  if (flat_) reshard();
}

void UnitRuntime::free_unsharded() {
  wait_pending_gather();  // the all-gather writes into the buffer
  std::optional<HeldMemory> held = flat_->reshard();
  if (!held) return;
  // See Note [Copy-in on a stream of its own].
  if (root_ != nullptr && root_->in_iteration()) {
    root_->hold(std::move(*held));
  } else {
    held->release();
  }
}

void UnitRuntime::refuse_if_summoned(const char* pass) const {
  // Before any state changes: SummonFullParams' end needs the unit idle.
  FSDP_CHECK(!flat_ || flat_->state() != FlatParameter::State::kSummoned, flat_->group().rank(),
             path_, "cannot run a ", pass, " through ", label(),
             " inside SummonFullParams: its parameters hold their full-precision values in a "
             "buffer of their own there (mixed precision or offload_to_cpu; Note [Summoning in "
             "full precision]). Run it after the guard ends");
  FSDP_CHECK(!held_by_summon_guard(), flat_->group().rank(), path_, "cannot run a ", pass,
             " through ", label(),
             " inside SummonFullParams (Note [Nested summons]): it would free the full "
             "parameters the guard holds, or gather them on some ranks only. Run it after the "
             "guard ends");
}

void UnitRuntime::pre_forward() {
  const OutsideInferenceMode outside;  // See Note [Inference mode].
  refuse_if_summoned("forward");
  FSDP_RECORD("pre_forward", path_);
  if (checkpoint_phase() == CheckpointPhase::kRecompute) {
    // Backward recomputes this unit's forward (Note [Activation
    // checkpointing]): the gather that pre_backward would make happens here,
    // and the iteration's state, order and reductions stay as they are.
    if (!flat_) return;
    prepare_slots();
    unshard();
    return;
  }
  refuse_shards_as_checkpoint_params();
  if (root_ == nullptr) {  // the first forward of the outermost unit: it is the root
    owned_root_ = std::make_unique<RootState>(*this);
  }
  begin_forward_state();
}

void UnitRuntime::refuse_shards_as_checkpoint_params() const {
  // A region's gradients reach only its params (Note [Activation
  // checkpointing]); the unit's forward reads its original parameters, so
  // given the shards (the wrapper's parameters()) the unit trained nothing.
  if (checkpoint_phase() != CheckpointPhase::kForward) return;
  for (const at::Tensor& shard : optim_params_) {
    FSDP_CHECK(!checkpoint_region_takes(shard), flat_->group().rank(), path_,
               "activation_checkpoint's params hold ", label(), "'s flat shard (",
               driver_ == Driver::kDispatch ? "the Unit's flat_parameters()"
                                            : "the wrapper's parameters()",
               "), which the checkpointed function does not read, so the unit's parameters "
               "would get no gradient through it. Pass the parameters the function reads, ",
               driver_ == Driver::kDispatch
                   ? "the module's own parameters()"
                   : "the wrapped module's own (unit->module().parameters())",
               ", or checkpoint with CheckpointWrapper or FSDPOptions::activation_checkpointing, "
               "which find them");
  }
}

void UnitRuntime::begin_forward_state() {
  if (root_ != nullptr) root_->release_kept();  // Note [The first unit of backward stays gathered]
  buffers_listed_.reset();  // listed anew, should one be replaced (holds_buffer)
  if (state_ != State::kIdle) abandon_iteration();
  const ReducedGradHooks* hooks = is_root() ? grad_hooks() : nullptr;
  if (hooks && hooks->before_forward) {
    hooks->before_forward();  // See Note [Steps during backward].
  }
  transition(State::kForward);
  if (flat_ && !flat_->unsharded().device().is_cpu()) {
    forward_stream_ = current_stream(flat_->unsharded().device());
  }
  if (is_root()) {
    root().exec_order().begin_forward(self_->is_training(), at::GradMode::is_enabled());
    root().begin_forward();
  }
  forward_position_ = root().next_forward_position();
  if (!flat_) return prefetch_targets(forward_targets_);
  root().exec_order().before_unshard(handle_);  // See Note [Forward order].
  prepare_slots();
  unshard();
  prefetch_forward();
}

void UnitRuntime::prepare_slots() {
  // requires_grad(false) set on the shard after wrapping freezes the unit's
  // original parameters too, so autograd computes no gradient for them.
  // (With use_orig_params, per parameter: its piece, or the original itself.)
  const bool per_param = options_.use_orig_params();
  const bool trainable =
      per_param ? flat_->shard().requires_grad() : follow_parameters_frozen_by_user();
  trainable_slots_ = 0;
  const auto& slots = flat_->slots();
  // A unit driven by dispatch keeps them until its pre_backward: the user's
  // Module::zero_grad() reaches the shards' gradients only through them, and
  // may come after a forward that no backward followed (evaluation).
  if (driver_ == Driver::kWrapper) clear_moved_grads();
  for (size_t i = 0; i < slots.size(); ++i) {
    // The module's own parameter object: only its flag changes.
    at::Tensor param = slots[i].param;
    bool want = trainable;
    if (per_param) {  // Note [Freezing after wrapping]
      at::Tensor piece = optim_params_[i];
      if (param.requires_grad() != params_given_[i]) piece.set_requires_grad(param.requires_grad());
      want = piece.requires_grad();
      params_given_[i] = want;
    }
    if (param.requires_grad() != want) param.set_requires_grad(want);
    trainable_slots_ += want ? 1 : 0;
  }
  grads_expected_ = trainable_slots_;
}

void UnitRuntime::clear_moved_grads() {
  // The last backward's moved gradient (a placeholder) must not meet
  // AccumulateGrad: the next backward's gradient starts afresh.
  // A gradient still shown is shown again at the end of this backward
  // (kHidden), whether or not it adds to it.
  drop_grads_the_user_dropped();
  const auto& slots = flat_->slots();
  for (size_t i = 0; i < slots.size(); ++i) {
    at::Tensor param = slots[i].param;
    const bool shown = is_placeholder(param.grad());
    if (shown) param.mutable_grad().reset();
    moved_grads_[i] =
        shown && moved_grads_[i] != MovedGrad::kNone ? MovedGrad::kHidden : MovedGrad::kNone;
  }
  dropped_grad_options_.clear();
}

void UnitRuntime::set_prefetch_targets(const std::vector<Unit*>& units, bool backward) {
  std::vector<PrefetchTarget> targets;
  for (size_t i = 0; i < units.size(); ++i) {
    FSDP_CHECK(units[i] != nullptr && units[i]->is_active(), flat_ ? flat_->group().rank() : -1,
               path_,
               backward ? "set_modules_to_backward_prefetch" : "set_modules_to_forward_prefetch",
               "'s entry ", i, " is ", units[i] == nullptr ? "null" : "a pass-through wrapper",
               ", not an FSDP unit. Pass units: fsdp::unit_of(module) of modules made units");
    UnitRuntime& target = units[i]->runtime();
    targets.push_back({&target, target.alive()});
  }
  (backward ? backward_targets_ : forward_targets_) = std::move(targets);
}

void UnitRuntime::prefetch() {
  // Not under way, not gathered already, not the guard's (Note [Nested
  // summons]), not in a backward that does not gather it (Note [Units
  // backward does not gather]).
  if (state_ != State::kIdle || flat_ == nullptr ||
      flat_->state() != FlatParameter::State::kSharded || held_by_summon_guard() ||
      (!unshard_in_backward_ && root_ != nullptr && root_->in_backward())) {
    return;
  }
  FSDP_RECORD("all_gather", path_);
  unshard_async(/*prefetch=*/true);
}

void UnitRuntime::prefetch_targets(const std::vector<PrefetchTarget>& targets) {
  for (const PrefetchTarget& t : targets) {
    if (const std::shared_ptr<const void> alive = t.alive.lock()) t.unit->prefetch();
  }
}

void UnitRuntime::prefetch_forward() {
  prefetch_targets(forward_targets_);
  if (!options_.forward_prefetch()) return;
  // The next unit of the first iteration's order starts gathering now; its
  // own pre_forward waits for it.
  if (Unit* next = root().exec_order().next(handle_)) next->runtime_->prefetch();
}

void UnitRuntime::post_forward(const std::vector<at::Tensor>& outputs,
                               const char* unknown_output_type) {
  const OutsideInferenceMode outside;  // See Note [Inference mode].
  FSDP_RECORD("post_forward", path_);
  const CheckpointPhase phase = checkpoint_phase();
  if (phase == CheckpointPhase::kRecompute) {
    // Recomputed in backward: the parameters stay gathered for the backward
    // that comes next, whose start these hooks mark.
    hook_outputs(outputs);
    return;
  }
  if (is_root()) root().exec_order().end_forward();
  transition(State::kIdle);
  if (is_root()) root().release_held(/*keep_newest=*/false);
  // A forward under activation checkpointing runs without grad mode, but
  // backward will reach this unit through the recomputation: it reshards
  // and joins the reduction order as a grad-mode forward does.
  const bool grad_enabled = at::GradMode::is_enabled() || phase == CheckpointPhase::kForward;
  FSDP_CHECK(
      unknown_output_type == nullptr || !grad_enabled || !flat_ || !flat_->shard().requires_grad(),
      flat_ ? flat_->group().rank() : -1, path_, "the forward of ", label(), " (", module_name(),
      ") returns ", c10::demangle(unknown_output_type),
      ", in which libfsdp cannot find the tensors that backward starts from, so it "
      "cannot gather the unit's parameters for backward. Return at::Tensor, "
      "std::vector<at::Tensor>, or a std::tuple / std::pair of these");
  if (!grad_enabled) {
    if (flat_ && frees_after_forward(/*backward_follows=*/false)) reshard();
    return;
  }
  const bool backward_reaches = hook_outputs(outputs) || phase == CheckpointPhase::kForward;
  if (flat_ && frees_after_forward(/*backward_follows=*/true)) {
    if (backward_reaches && !is_root() && options_.backward_prefetch() != BackwardPrefetch::kNone) {
      root().keep_for_backward(*this);  // See Note [The first unit of backward stays gathered].
    } else {
      reshard();
    }
  }
  if (backward_reaches && flat_ && trainable_slots_ > 0) root().join_reduction_order(*this);
}

// Note [The first unit of backward stays gathered]
// FSDP1 and FSDP2 reshard every non-root unit after its forward and gather it
// again before its backward. Backward starts with the unit whose forward
// ended last, so for that one unit the gather comes right after the free: the
// model's tail (the rest of the root's forward, the loss and their backward)
// is too short to hide it, and it is waited for in full (at 1 Gbit/s, 67 ms
// of a 1.6 s GPT-mini step; bench/network_overlap.sh). Only the end of the
// forward tells which unit that is, so a unit whose forward ends stays
// gathered (RootState's kept unit) until the next unit's forward begins, when
// it reshards as FSDP's schedule would have; the last one is still gathered
// when its backward begins: one all-gather fewer per step. It frees its
// parameters when its gradient reduction starts, as every unit does. A
// forward that no backward follows leaves it gathered until the next forward
// begins, which regathers it: an optimizer step in between may have changed
// its shard.
//
// Memory: one unit more, only during the tail, below the peak of that unit's
// backward (itself, BACKWARD_PRE's prefetch and its gradient). Ranks agree
// without communicating: each skips the backward gather of the unit it ran
// last, one per step, so ranks whose forward orders differ (warned by Note
// [Forward order]) still issue the same number of gathers, which pair by issue
// order as with FSDP's schedule. Without backward prefetch the user chose the
// smallest footprint, and gets FSDP's schedule.
//
// Measured on 2 simulated nodes at 1 Gbit/s, FSDP's schedule against this,
// rounds interleaved: 8-block GPT-mini 0.93x per step (median of 4 rounds;
// another run of 3: 1613 -> 1524 ms); 4 blocks 0.99x, within the noise.
// Also tried, and slower (1654 ms at 8 blocks): gathering the unit that
// backward needs second during the last unit's forward, so the network would
// not idle there; it then competes with that forward for the two cores.

bool UnitRuntime::hook_outputs(const std::vector<at::Tensor>& outputs) {
  bool hooked = false;
  for (const at::Tensor& output : outputs) hooked = hook_output(output) || hooked;
  return hooked;
}

bool UnitRuntime::hook_output(const at::Tensor& output) {
  if (!output.defined() || !output.requires_grad()) return false;
  // See Note [FSDP and autograd]. The first of the outputs whose gradient
  // arrives runs pre_backward; it is idempotent per backward. (A hook is
  // registered on the output's autograd meta, shared by every copy of it.)
  output.register_hook([this](const at::Tensor&) { pre_backward(); });
  return true;
}

void UnitRuntime::pre_backward() {
  refuse_if_summoned("backward");
  // Dispatch-driven units learn here that their forward is over; this one's
  // parameters are needed now (Note [Units driven by dispatch]).
  if (root().forward_in_progress()) root().settle_forward(this);
  root().queue_end_of_backward();      // set at the root's first forward, before any hook
  if (state_ != State::kIdle) return;  // another of its outputs got there first
  FSDP_RECORD("pre_backward", path_);
  transition(State::kPreBackward);
  root().forget_kept(*this);
  expect_grads_of_this_backward();
  if (has_frozen_reads()) frozen_reads_ = FrozenReads::kPending;
  if (flat_) {
    // A second backward through the same graph (retain_graph) accumulates
    // into the shards' gradients as plain LibTorch accumulates into .grad.
    clear_moved_grads();
    if (unshard_in_backward_) unshard();  // Note [Units backward does not gather]
  }
  // Targets gone leave the choice to backward_prefetch again.
  backward_targets_.erase(std::remove_if(backward_targets_.begin(), backward_targets_.end(),
                                         [](const PrefetchTarget& t) { return t.alive.expired(); }),
                          backward_targets_.end());
  if (!backward_targets_.empty()) {
    prefetch_targets(backward_targets_);
  } else if (options_.backward_prefetch() == BackwardPrefetch::kBackwardPre) {
    prefetch_backward();
  }
  // Nothing to wait for: complete where its backward begins (Note
  // [Gradients a backward computes]), after the gathers every rank issues
  // here. Not in a backward that builds a graph (Note [Double backward]).
  if (flat_ && trainable_slots_ > 0 && grads_expected_ == 0 && !at::GradMode::is_enabled()) {
    launch_if_complete();
  }
}

// Note [Units backward does not gather]
// FSDP2's set_unshard_in_backward(false): a FULL_SHARD unit whose backward
// does not read its parameters (an Embedding: its weight's gradient is
// built from the indices and the output's gradient) need not gather them
// where backward reaches it; pre_backward and the backward prefetches skip
// it, and its gradient arrives into the flat gradient as usual. Only units
// made by fully_shard take it: their parameters' reads are reported
// (Note [Units driven by dispatch]), so a backward that does read them
// (the setting was wrong: a Linear, a custom autograd Function's saved
// weight) gathers them at that read and computes what plain LibTorch does.
// A wrapper's backward reads the views it saved in forward unseen.
// The agreement on uneven backwards (RootState::agree_received_grads) asks
// such a unit whether it gathered in this backward (such a read, or an
// activation-checkpointed recomputation, which gathers whatever the
// setting), not whether backward reached it: ranks that differ there would
// issue different all-gathers.

// Note [Parameters backward reads without a gradient]
// A unit reshards when its gradient's reduction launches: every node that
// read a trainable parameter has run by then (each has an edge to its
// AccumulateGrad). A frozen parameter has no AccumulateGrad, yet backward
// may still read it after that: LoRA's frozen base weight (the gradient of
// its input), a frozen layer ahead of the trainable ones in a unit. Freed,
// those nodes read an empty storage (LibTorch's "setStorage ... out of
// bounds"). So a unit with frozen parameters (use_orig_params, or frozen
// whole) keeps its buffer from pre_backward until backward has passed it:
// the gradients of all its forward's inputs that require one were computed
// (hooks on them, as PyTorch's FSDP reshards frozen units when a multi-grad
// hook on their inputs fires, and FSDP2 every unit). It then reshards, or
// at its reduction's launch if that comes later. A unit fully_shard made has
// no forward arguments: the arguments of each operator on its parameters
// count instead (param_use_arguments; its own parameters aside), so its
// reads are over once the gradients of all of them are computed. Where the
// inputs are not known (an argument type that may hide tensors, another
// unit's parameter or a checkpointed region among a fully_shard unit's
// operators, none requiring a gradient, a second backward through a
// retained graph, a backward through a graph a backward built) it reshards
// at the end of backward: more memory, never a freed read. The inputs counted are those of
// every forward since the last backward ended (two forwards before one
// backward: both graphs read the parameters); a hook fires once per backward
// at most, so the count completes only when every one of them has. A frozen
// parameter read by a node whose gradient leaves the unit only through a
// tensor that is no argument (a member of another module) is not covered.
bool UnitRuntime::has_frozen_reads() const {
  return flat_ && flat_->frees_unsharded() && trainable_slots_ < flat_->slots().size();
}

void UnitRuntime::record_forward_inputs(const std::vector<at::Tensor>& inputs, bool all_found) {
  const CheckpointPhase phase = checkpoint_phase();
  if (!has_frozen_reads() || phase == CheckpointPhase::kRecompute) return;
  if (!at::GradMode::is_enabled() && phase != CheckpointPhase::kForward) return;  // no backward
  if (!all_found) {
    inputs_hooked_.reset();
    return;
  }
  for (const at::Tensor& input : inputs) {
    if (!input.defined() || !input.requires_grad()) continue;
    if (inputs_hooked_) ++*inputs_hooked_;
    const unsigned handle = input.register_hook(
        [this, epoch = input_epoch_](const at::Tensor&) { input_grad_computed(epoch); });
    // A leaf (a parameter passed as an argument) keeps its hooks as long as
    // it lives, past this iteration and this unit: removed when forgotten.
    // Another tensor's hook goes with its graph.
    if (input.is_leaf()) leaf_input_hooks_.emplace_back(input, handle);
  }
}

void UnitRuntime::input_grad_computed(uint64_t epoch) {
  // Not in a backward that builds a graph: the one through that graph
  // reads the parameters again (Note [Double backward]).
  if (at::GradMode::is_enabled()) return;
  if (epoch != input_epoch_ || !inputs_hooked_ || ++inputs_reached_ < *inputs_hooked_) return;
  if (frozen_reads_ != FrozenReads::kPending) return;
  frozen_reads_ = FrozenReads::kNone;
  // A reduction still to launch reshards the unit when it does.
  if (trainable_slots_ == 0 || reduction_launched()) {
    reshard_in_backward();
  } else if (!require_sync() && grads_ready_ == grads_expected_) {
    launch_if_complete();  // no reduction to launch: See Note [Resharding under no_sync]
  }
}

void UnitRuntime::forget_forward_inputs() {
  ++input_epoch_;
  inputs_hooked_ = 0;
  inputs_reached_ = 0;
  for (auto& [input, handle] : leaf_input_hooks_) input.remove_hook(handle);
  leaf_input_hooks_.clear();
}

// Note [Gradients a backward computes]
// A unit's reduction may launch once every gradient this backward computes
// for it has arrived (Note [Reduction order]). Counting every trainable
// slot instead held a unit back until the end of backward on the ranks
// whose data left part of it unused (an expert no token went to, a branch
// some batches skip), while on the others it launched as its gradients
// came: under FULL_SHARD, which gathers again in backward, the ranks' gathers
// and reductions then paired out of order, silently exchanging gradients and
// parameters of same-sized units. Which AccumulateGrad nodes run is known
// when backward reaches the unit's outputs: those of the graph task's nodes.
// The unit is complete when those arrived: on every rank at the point where its
// backward ends (autograd runs each AccumulateGrad before the nodes of
// earlier units, which wait for the gradients this unit's inputs get), as
// PyTorch's FSDP completes a unit when its FlatParameter's one
// AccumulateGrad runs. A unit none of whose gradients are computed here (an
// expert no token went to, never called) is complete where its backward
// begins: after that unit's gathers, which every rank issues there, and at
// its place in the reduction order; the other ranks complete it before
// backward reaches earlier units. Left to the end of backward, it held back
// every later reduction on this rank only. A unit whose outputs no hook saw
// (Note [Double backward]) waits for the end, and so does every unit of a
// backward given its inputs (the nodes on its way to other inputs may read
// them). A backward
// of the user's own nested in this one that accumulates into a unit's
// parameters (a hand-written reentrant checkpoint) finds the unit reduced:
// an error naming it; fsdp::activation_checkpoint's recomputation returns
// its gradients to this backward instead.
void UnitRuntime::expect_grads_of_this_backward() {
  grads_expected_ = trainable_slots_;
  const auto* in_graph = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (!flat_ || in_graph == nullptr || in_graph->empty()) return;
  // A backward given its inputs may still run nodes that read this unit's
  // other parameters, on its way to other inputs: it waits for the end.
  const auto* info = torch::autograd::get_current_graph_task_exec_info();
  if (info != nullptr && !info->empty()) return;
  size_t computed = 0;
  for (const auto& slot : flat_->slots()) {
    if (!slot.param.requires_grad()) continue;  // prepare_slots left it out
    const auto acc = torch::autograd::impl::try_get_grad_accumulator(slot.param);
    if (acc && in_graph->count(acc.get()) != 0) ++computed;
  }
  grads_expected_ = computed;
}

void UnitRuntime::prefetch_backward() {
  // Backward runs the first iteration's forward order in reverse: the unit
  // recorded before this one is the next to need its parameters.
  if (root_ == nullptr) return;
  if (Unit* next = root_->exec_order().previous(handle_)) next->runtime_->prefetch();
}

void UnitRuntime::on_grad_ready(size_t slot) {
  const auto& param = flat_->slots()[slot].param;
  if (!param.grad().defined()) {
    // AccumulateGrad ran without a gradient (a checkpointed region's unused
    // parameter: its recomputation's grad() returns none). Computed all the
    // same, as zeros: the unit completes where its backward ends on every
    // rank (Note [Gradients a backward computes]).
    if (!reduction_launched()) note_grad_arrived();
    return;
  }
  FSDP_CHECK(!reduction_launched(), flat_->group().rank(), path_, "a gradient of '",
             flat_->slots()[slot].name, "' arrived after ", label(),
             "'s reduction was launched (Note [Gradients a backward computes]): autograd ran its "
             "AccumulateGrad outside the graph task that reached the unit's outputs. Compute "
             "the gradients of a unit's parameters in the backward that reaches its outputs");
  // Note [The stream of a gradient's hook]
  // Autograd runs this hook, an AccumulateGrad's, on the stream that was
  // current when the AccumulateGrad was made, at wrapping, having made that
  // stream wait for the gradient. The unit's backward kernels run on its
  // forward's stream (a user's CUDAStreamGuard around training, entered
  // after wrapping): what this hook queues (the copy into the flat gradient,
  // the reduction, the memory held at the reshard, the steps beside
  // backward, queued behind the hand-over's stream) belongs there too, after
  // the gradient; and the hook's own stream waits for it at the end, as the
  // end of backward waits only for that one, and the gradient's memory may
  // be that stream's (AccumulateGrad's clone of a gradient it cannot take).
  std::optional<Detour> on_forward_stream;
  if (forward_stream_) on_forward_stream.emplace(*forward_stream_);
  if (at::GradMode::is_enabled()) {
    // See Note [Double backward]. The gradient and its graph are dropped
    // first: a later backward would add to it.
    at::Tensor(param).mutable_grad() = at::Tensor();
    FSDP_FAIL(flat_->group().rank(), path_,
              "a backward with create_graph=true computed gradients of the parameters of ", label(),
              " (", flat_->slots()[slot].name,
              "): libfsdp reduces and shards a unit's gradients as they arrive, so they cannot "
              "carry a graph for a second backward. For a gradient penalty take the gradient of "
              "the inputs, torch::autograd::grad({out}, {input}, {}, /*retain_graph=*/true, "
              "/*create_graph=*/true), and call backward() on the loss that uses it");
  }
  // A backward that reaches this unit only through a graph an earlier
  // backward built may run no output hook (Note [Double backward]).
  if (root_ != nullptr) root_->queue_end_of_backward();
  // Note [Filling the flat gradient]
  // The buffer starts uninitialised: a slot's first gradient is copied in,
  // later ones (inside no_sync(), the buffer lives across backwards) are
  // added; slots that got none and the padding are zeroed just before the
  // reduction. Zero-filling up front and adding cost a unit-sized memset and
  // a third more memory traffic per backward.
  if (!flat_grad_.defined()) {
    flat_grad_ = flat_->new_flat_grad();
    slot_filled_.assign(flat_->slots().size(), false);
  }
  at::Tensor dst = flat_->slot_view(flat_grad_, slot);
  // A sparse gradient (torch::nn::Embedding with sparse(true)) lands in the
  // dense flat gradient: the reduction is dense, and a dense step moves the
  // parameter as the sparse one does in plain LibTorch.
  const at::Tensor grad = param.grad().is_sparse() ? param.grad().to_dense() : param.grad();
  if (slot_filled_[slot]) {
    dst.add_(grad.reshape({-1}));
  } else {
    dst.copy_(grad.reshape({-1}));
    slot_filled_[slot] = true;
  }
  at::Tensor(param).mutable_grad() = grad_placeholders_[slot];
  moved_grads_[slot] = MovedGrad::kShown;
  note_grad_arrived();
}

void UnitRuntime::note_grad_arrived() {
  ++grads_ready_;
  launch_if_complete();
}

// Note [Resharding under no_sync]
// Inside no_sync() no reduction launches, and a unit's reshard in backward
// came only with its reduction: every unit stayed gathered until the end of
// backward, the whole model unsharded at once on top of the unsharded
// gradients no_sync keeps (an out-of-memory PyTorch does not have). As
// PyTorch's FSDP (_should_free_in_backward: FULL_SHARD and HYBRID_SHARD free
// in backward whether or not gradients sync), a unit whose strategy
// reshards after forward frees its parameters once its gradients are all
// computed (and backward has passed its frozen reads); SHARD_GRAD_OP's stay
// gathered until the end of backward, as there.
void UnitRuntime::launch_if_complete() {
  if (grads_ready_ != grads_expected_) return;
  if (!require_sync()) {
    // See Note [Resharding under no_sync].
    // FSDP1's rule (SHARD_GRAD_OP's stay gathered), or FSDP2's where the
    // user set reshard_after_forward: reshard_after_backward decides.
    if (flat_ && (reshard_after_forward_.has_value() ||
                  reshards_after_forward(options_.sharding_strategy()))) {
      reshard_in_backward();
    }
    return;
  }
  if (root_ != nullptr && !root_->reduces_in_backward(*this)) return;  // kept for the next
  if (root_ == nullptr || !root_->in_reduction_order(*this)) {
    launch_grad_reduction();  // not from this iteration's forward: nothing to order it by
  } else {
    root_->launch_ready_reductions();  // See Note [Reduction order].
  }
}

// Note [Accumulating within the node]
// PyTorch FSDP2's set_requires_all_reduce(false), for gradient accumulation
// under hybrid sharding: each micro-batch's gradient is reduce-scattered
// within the node (memory stays sharded, unlike no_sync's unsharded
// gradients) but not all-reduced across the nodes; the node averages are
// summed into within_node_grad_ and .grad is left as it is. The sum is kept
// in the dtype .grad accumulates in (FSDP2 keeps the reduce dtype: a bf16
// sum rounds every micro-batch), on the device that reduced it (under CPU
// offload, the GPU: a shard of float32 per unit while it is kept). The next
// synchronising backward with it on adds that sum to its own
// reduce-scattered shard before the one all-reduce (kAvg over the nodes of
// a sum of node averages: the job's average of every micro-batch, as plain
// LibTorch accumulates), then sets .grad, or hands it over early (Note
// [Steps during backward]); a unit without a forward in that iteration
// reduces zeros with it (RootState::end_of_backward, by kept_within_node_,
// which every rank has alike). The slots that had a
// gradient in any kept backward count as having one in the agreement (Note
// [Parameters without gradients]), which still crosses the nodes once per
// backward (a few bytes over the world group). The model's zero_grad()
// drops what is kept, as it drops no_sync's gradients (the optimizer's
// reaches .grad only), and an original parameter's gradient zeroed or reset
// drops its part. Nothing is handed
// over early or copied to host memory from a reduction that stays in the
// node; after it, what the agreement says got a gradient shows one, as
// after any reduction, so every rank's user clears the same slots. How far
// a reduction goes is decided when it launches (grad_reach_); one that
// crosses the nodes takes the kept sum with it (a backward that throws
// after that drops both, as it drops the reduction).
bool UnitRuntime::reduces_within_node_only() const {
  return !requires_all_reduce_ && replicate_group_ && replicate_group_->size() > 1;
}

void UnitRuntime::launch_grad_reduction() {
  TORCH_INTERNAL_ASSERT(!grad_work_, "fsdp: gradient reduction launched twice");
  if (!flat_grad_.defined()) {  // no gradient on this rank: zeros (Note [Reduction order])
    flat_grad_ = flat_->new_flat_grad();
    slot_filled_.assign(flat_->slots().size(), false);
  }
  for (size_t i = 0; i < slot_filled_.size(); ++i) {
    if (!slot_filled_[i]) flat_->slot_view(flat_grad_, i).zero_();
  }
  warn_unused_slots();
  flat_->zero_padding(flat_grad_);
  {
    FSDP_RECORD(flat_->keeps_unsharded() ? "all_reduce" : "reduce_scatter", path_);
    // See Note [Accumulating within the node].
    grad_reach_ = reduces_within_node_only() ? GradReach::kNode : GradReach::kJob;
    GradReductionOptions how;
    if (grad_reach_ == GradReach::kJob) {
      how.replicate = replicate_group_;
      // Taken by this reduction (its chain keeps it alive until it ended).
      how.within_node = std::exchange(within_node_grad_, at::Tensor());
      kept_within_node_ = false;
    }
    how.divide_factor = gradient_divide_factor_;
    GradReduction reduction = reduce_unit_grad(*flat_, flat_grad_, how, label());
    grad_shard_ = std::move(reduction.shard);
    grad_work_ = std::move(reduction.work);
  }
  flat_grad_ = at::Tensor();  // the Work keeps it alive until reduced
  if (root_ != nullptr) root_->limit_reductions_in_flight(grad_work_);
  // From kIdle when backward never reached this unit here (it reduces zeros).
  if (state_ == State::kPreBackward) transition(State::kPostBackward);
  reshard_in_backward();
  if (backward_targets_.empty() &&
      options_.backward_prefetch() == BackwardPrefetch::kBackwardPost) {
    prefetch_backward();
  }
  if (can_deliver_early()) {
    deliver_early();  // Note [Steps during backward]
  } else if (can_copy_out_early()) {
    copy_out_early();
  }
}

bool UnitRuntime::can_copy_out_early() const {
  return root_ != nullptr && root_->in_backward() && grad_work_ && grad_reach_ == GradReach::kJob &&
         flat_->shard_pinned() && has_streams(grad_shard_.device()) && stream_can_wait(grad_work_);
}

void UnitRuntime::copy_out_early() {
  const c10::Device device = grad_shard_.device();
  {
    // See Note [Gradients to host memory]: behind the reduction, beside the
    // backward kernels that follow it.
    const SideStreamScope copy_out(device, SideStream::kCopyOut, /*wait_for_current=*/false);
    grad_work_.block_current_stream();
    at::Tensor host = start_grad_copy_to_host(grad_shard_);  // a throw changes nothing
    grad_on_device_ = std::exchange(grad_shard_, std::move(host));
    copy_out_ = CopyOut::kQueued;
    const c10::impl::VirtualGuardImpl impl(device.type());
    copied_out_.emplace(device.type());
    copied_out_->record(impl.getStream(device));
  }
  root_->release_copied_out(*this);
}

bool UnitRuntime::release_copied_out(bool wait) {
  if (!grad_on_device_.defined()) return true;
  // Never freed while the copy-out stream reads it: the caching allocator
  // would hand its block to the next allocation of the stream it was made
  // on at once (Note [Copy-in on a stream of its own]: events, never
  // recordStream).
  if (!copied_out_) {  // its event was never recorded (a throw): the whole stream
    if (!wait) return false;
    wait_for_side_stream(grad_on_device_.device(), SideStream::kCopyOut);
  } else if (wait) {
    compat::synchronize_event(*copied_out_);
  } else if (!copied_out_->query()) {
    return false;
  }
  grad_on_device_ = at::Tensor();
  copied_out_.reset();
  return true;
}

at::Tensor UnitRuntime::start_grad_copy_to_host(const at::Tensor& reduced) const {
  return start_host_copy(reduced, shard_grad_options().dtype().toScalarType());
}

bool UnitRuntime::can_deliver_early() const {
  if (!grad_hooks() || !require_sync() || root_ == nullptr || !root_->in_backward() ||
      !grad_work_ || grad_reach_ == GradReach::kNode || slot_filled_.empty()) {
    return false;
  }
  // Only what the end-of-backward agreement cannot change (Note [Parameters
  // without gradients]): a flat shard that got some gradient here, or
  // pieces that all got theirs here.
  const auto& slots = flat_->slots();
  bool any = false;
  for (size_t i = 0; i < slots.size(); ++i) {
    const bool filled = i < slot_filled_.size() && slot_filled_[i];
    any = any || filled;
    if (options_.use_orig_params() && slots[i].param.requires_grad() && !filled) return false;
  }
  return any;
}

namespace {

// Note [Copies queued at the hand-over]
// A gradient handed to a listener (Note [Steps during backward]) goes to host
// memory under CPU offload. Where it is on a GPU and a stream can wait for
// its reduction, the copy is queued at the hand-over, on backward's thread,
// on the step-copy stream behind the reduction: each unit's copy then runs
// while the listener still steps the units handed over before it. Queued by
// the listener after its host wait for the reduction, as it was, every copy
// started only once everything before it was stepped, and the host's cores
// idled through it: on GPT-2 small, 12 blocks' gradients of 28 MB each in
// series with their steps, a step the listener could not keep up with
// beside an H200's backward. Elsewhere (the CPU, a reduction the host must
// wait for) the listener still copies after its wait.
bool copies_at_hand_over(const Work& work, const at::Tensor& reduced, bool pinned) {
  // FSDP_COPY_AT_HAND_OVER=0: the listener copies (an A/B of the two).
  return env_switch_on("FSDP_COPY_AT_HAND_OVER") && pinned && reduced.is_cuda() &&
         has_streams(reduced.device()) && stream_can_wait(work);
}

// Queues `copy`'s parts from `reduced` behind `work` on the step-copy stream
// (copies_at_hand_over), without blocking the host. FSDP_FAULT_STEP_COPY_NO_WAIT=1
// drops the wait: a GPU test shows the copies then read the reduced shard
// before the reduction wrote it (tests/core/test_cuda_streams.cpp).
void start_behind(HostCopyInParts& copy, const Work& work, const at::Tensor& reduced) {
  const SideStreamScope step_copy(reduced.device(), SideStream::kStepCopy,
                                  /*wait_for_current=*/false);
  const char* fault = std::getenv("FSDP_FAULT_STEP_COPY_NO_WAIT");
  if (fault == nullptr || std::string(fault) != "1") work.block_current_stream();
  copy.start(reduced);
}

// The elements each of `targets` gets of `reduced`.
std::vector<int64_t> target_sizes(const std::vector<GradTarget>& targets,
                                  const at::Tensor& reduced) {
  std::vector<int64_t> sizes;
  for (const GradTarget& t : targets) sizes.push_back(t.numel < 0 ? reduced.numel() : t.numel);
  return sizes;
}

// Note [Stepping a gradient as it lands]: `reduced` (the targets' gradient,
// in `plan`'s parts) copied into a host tensor per target, each part
// readable once it has landed where the hooks see the parts (`parts_seen`;
// else complete() waits for them all). The targets' .grad take those
// tensors before anything has landed, so a .grad to add into (kept from an
// earlier backward) waits for the whole copy first.
void hand_over_in_parts(ReducedGrad& grad, Work work, at::Tensor reduced,
                        std::vector<GradTarget> targets,
                        const std::vector<std::vector<ParamRange>>& plan, bool parts_seen,
                        c10::ScalarType dtype, bool pinned, const std::string& owner) {
  // 1-D, as the shard and its pieces, and no views: a .grad takes each
  // itself before its values have landed, where a view would be cloned.
  std::vector<at::Tensor> dsts;
  for (const GradTarget& t : targets) {
    dsts.push_back(host_buffer(t.numel < 0 ? reduced.numel() : t.numel, dtype, pinned, owner));
  }
  std::vector<std::vector<HostCopyInParts::Segment>> segments;
  for (const auto& part : plan) {
    segments.emplace_back();
    for (const ParamRange& r : part) {
      const int64_t at = targets[r.param].numel < 0 ? 0 : targets[r.param].offset;
      segments.back().push_back({r.param, r.begin, at + r.begin, r.end - r.begin});
    }
  }
  auto copy = std::make_shared<HostCopyInParts>(std::move(dsts), std::move(segments));
  for (size_t i = 0; parts_seen && i < plan.size(); ++i) {
    grad.parts.push_back({[copy, i] { copy->wait(i); }, plan[i]});
  }
  const bool started = copies_at_hand_over(work, reduced, pinned);
  if (started) start_behind(*copy, work, reduced);
  grad.complete = [work = std::move(work), reduced = std::move(reduced),
                   targets = std::move(targets), copy, started, parts_seen]() mutable {
    work.wait();
    bool takes = true;
    for (size_t i = 0; i < targets.size(); ++i) {
      takes = takes && takes_reduced_grad(targets[i].param, copy->dsts()[i]);
    }
    if (!started) copy->start(reduced);
    if (!takes || !parts_seen) copy->wait_all();
    for (size_t i = 0; i < targets.size(); ++i) {
      at::Tensor param = targets[i].param;
      if (takes) {
        take_reduced_grad(param, copy->dsts()[i]);  // checked above, the .grad read once
      } else {
        accumulate_reduced_grad(param, copy->dsts()[i]);
      }
    }
    work = Work();
    reduced = at::Tensor();  // the copy holds it until its parts have landed
  };
}

}  // namespace

void UnitRuntime::deliver_early() {
  // Received (can_deliver_early): a flat shard's whole gradient, or each
  // piece that got one here.
  std::vector<bool> filled = slot_filled_;
  filled.resize(flat_->slots().size(), false);
  std::vector<GradTarget> targets = grad_targets(options_.use_orig_params() ? &filled : nullptr);
  ReducedGrad grad = reduced_grad_for(targets);
  // Everything the completion needs, by value: it runs on the listener's
  // thread, and the unit goes on without it.
  const at::TensorOptions to = shard_grad_options();
  const c10::ScalarType dtype = to.dtype().toScalarType();
  const bool pinned = flat_->shard_pinned();
  Work work = std::exchange(grad_work_, Work());
  at::Tensor reduced = std::exchange(grad_shard_, at::Tensor());
  std::vector<std::vector<ParamRange>> plan = grad_parts(targets, reduced);
  const bool in_parts = plan.size() > 1;
  if (in_parts || copies_at_hand_over(work, reduced, pinned)) {
    // Whole, the copy queued now all the same: one part the hooks do not see.
    if (!in_parts) plan = plan_grad_parts(target_sizes(targets, reduced), 0);
    hand_over_in_parts(grad, std::move(work), std::move(reduced), std::move(targets), plan,
                       in_parts, dtype, pinned, label());
  } else {
    grad.complete = [work = std::move(work), reduced = std::move(reduced),
                     targets = std::move(targets), device = to.device(), dtype, pinned]() mutable {
      work.wait();
      // As grad_for_shard(); into pinned host memory without queueing behind
      // backward (Note [Gradients to host memory]).
      set_reduced_grads(targets,
                        pinned ? finished_to_host(reduced, dtype) : reduced.to(device, dtype));
      work = Work();
      reduced = at::Tensor();
    };
  }
  delivered_early_ = true;
  grad_hooks()->on_reduced(std::move(grad));
}

ReducedGrad UnitRuntime::reduced_grad_for(const std::vector<GradTarget>& targets) {
  ReducedGrad grad;
  for (const GradTarget& t : targets) grad.params.push_back(t.param);
  // FSDP_FAULT_STEP_OFF_STREAM=1 leaves the listener on its own thread's
  // stream: a GPU test shows the next forward then reads shards before their
  // step (tests/core/test_cuda_streams.cpp).
  if (grad_shard_.defined() && std::getenv("FSDP_FAULT_STEP_OFF_STREAM") == nullptr) {
    grad.stream = current_stream(grad_shard_.device());
  }
  // The flat shard only (use_orig_params' pieces step apart), of the unit
  // the recorded forward order unshards first.
  if (!copy_in_at_step_enabled() || !flat_ || targets.size() != 1 || targets[0].numel >= 0) {
    return grad;
  }
  const ExecOrder& order = root().exec_order();
  if (!order.recorded() || order.order().empty() || order.order().front() != &handle_) {
    return grad;
  }
  if (auto send = flat_->copy_in_ahead_sender()) {
    grad.stepped = [send = std::move(send)](const ParamRange& r) { send(r.begin, r.end); };
  }
  return grad;
}

std::vector<std::vector<ParamRange>> UnitRuntime::grad_parts(const std::vector<GradTarget>& targets,
                                                             const at::Tensor& reduced) const {
  // Only a gradient that lands in host memory, for a listener that reads
  // parts.
  const ReducedGradHooks* hooks = grad_hooks();
  if (!hooks || !hooks->takes_parts || !shard_grad_options().device().is_cpu()) {
    return {};
  }
  return plan_grad_parts(
      target_sizes(targets, reduced),
      grad_part_elements(/*goes_to_host=*/flat_->shard_pinned() && reduced.is_cuda()));
}

bool UnitRuntime::parts_at_end() const {
  // The targets are known only after the agreement (received): the whole
  // shard decides, and assign_reduced_grad copies what a smaller plan
  // leaves whole.
  return flat_->shard_pinned() && grad_shard_.is_cuda() &&
         grad_parts({{optim_params_[0], 0, grad_shard_.numel()}}, grad_shard_).size() > 1;
}

void UnitRuntime::warn_unused_slots() {
  if (options_.use_orig_params() || warned_unused_) return;
  // Only a unit that got some gradient here: one that got none may keep its
  // .grad (if no rank got one; Note [Reduction order]).
  if (std::find(slot_filled_.begin(), slot_filled_.end(), true) == slot_filled_.end()) return;
  std::string names;
  for (size_t i = 0; i < slot_filled_.size(); ++i) {
    const auto& slot = flat_->slots()[i];
    if (slot_filled_[i] || !slot.param.requires_grad()) continue;
    names += (names.empty() ? "" : ", ") + slot.name;
  }
  if (names.empty()) return;
  warned_unused_ = true;
  TORCH_WARN(error_prefix(flat_->group().rank(), path_), "parameters [", names,
             "] received no gradient in this backward on this rank (not used in the forward). "
             "With flat shards (use_orig_params=false) one gradient tensor holds the whole "
             "unit, so they get a zero gradient: plain SGD leaves them, but weight decay and "
             "momentum (AdamW, SGD with momentum) still move them, unlike plain LibTorch, "
             "where their .grad stays undefined. Pass FSDPOptions().use_orig_params(true) "
             "(they then keep an undefined .grad), or put them in a unit of their own. "
             "(Warned once per unit.)");
}

void UnitRuntime::keep_within_node() {
  kept_within_node_ = true;
  // In the dtype .grad accumulates in: a 16-bit reduce dtype would round
  // every micro-batch's sum (plain LibTorch accumulates in the parameters').
  const at::Tensor reduced = grad_shard_.to(shard_grad_options().dtype().toScalarType());
  within_node_grad_ = within_node_grad_.defined() ? within_node_grad_.add_(reduced) : reduced;
  within_node_filled_.resize(std::max(within_node_filled_.size(), slot_filled_.size()), false);
  for (size_t i = 0; i < slot_filled_.size(); ++i) {
    if (slot_filled_[i]) within_node_filled_[i] = true;
  }
}

void UnitRuntime::forget_within_node() {
  within_node_grad_ = at::Tensor();
  within_node_filled_.clear();
}

void UnitRuntime::forget_within_node_slot(size_t i) {
  if (i < within_node_filled_.size()) within_node_filled_[i] = false;
  if (!within_node_grad_.defined()) return;
  const FlatParameter::ShardPart part = flat_->shard_part(i);
  if (part.numel > 0) within_node_grad_.narrow(0, part.in_shard, part.numel).zero_();
}

bool UnitRuntime::finish_reduction() {
  if (!require_sync()) return false;  // no_sync(): the unsharded gradient waits for later
  // Gradients that arrived only in part (unused parameters), or only inside
  // no_sync(), are reduced now.
  if (flat_ && flat_grad_.defined() && !grad_work_) launch_grad_reduction();
  if (copy_out_ == CopyOut::kQueued) return true;
  if (grad_work_) {
    FSDP_RECORD("wait_reduction", path_);
    // The reduced shard is read by kernels on the compute stream: on a GPU
    // that stream waits, not the host (Note [A unit's collectives]).
    grad_work_.block_current_stream();
    if (grad_reach_ == GradReach::kNode) {  // Note [Accumulating within the node]
      keep_within_node();
      return false;
    }
    // Under CPU offload: the copy to host memory queued now, the host waits
    // once for every unit's (RootState::end_of_backward; Note [Gradients to
    // host memory]), unless the hooks copy it part by part as they step it
    // (Note [Stepping a gradient as it lands]).
    if (flat_->shard_pinned() && grad_shard_.is_cuda() && !parts_at_end()) {
      grad_shard_ = start_grad_copy_to_host(grad_shard_);
      return true;
    }
  }
  return false;
}

void UnitRuntime::finish_backward(const std::vector<bool>* received, bool reduced) {
  // Under no_sync(), or with no reduction (Note [Backward with respect to
  // inputs]), the unsharded gradient stays for the next backward.
  // See Note [Gradients the user clears]: what has a gradient shows it.
  // After a reduction that stayed within the node too, what the ranks agreed
  // got a gradient shows one, the same on every rank.
  show_moved_grads(require_sync() && reduced && reduction_launched(), received);
  if (require_sync() && reduced) {
    if (grad_work_ && grad_reach_ == GradReach::kJob) assign_reduced_grad(received);
    if (!kept_within_node_) within_node_filled_.clear();  // what it took is delivered
    delivered_early_ = false;
    grad_work_ = Work();
    grad_reach_ = GradReach::kJob;
    grad_shard_ = at::Tensor();
    release_copied_out(/*wait=*/true);  // the host waited for the copy-out stream already
    copy_out_ = CopyOut::kNone;
    flat_grad_ = at::Tensor();
  }
  reset_backward_progress();  // backward is over
  if (flat_) reshard_in_backward();
  if (state_ != State::kIdle) transition(State::kIdle);  // kIdle: backward never reached it
}

std::vector<GradTarget> UnitRuntime::grad_targets(const std::vector<bool>* received) const {
  std::vector<GradTarget> targets;
  if (!options_.use_orig_params()) {
    // No rank got a gradient: the shard's .grad stays as it was.
    if (received == nullptr || (*received)[0]) targets.push_back({optim_params_[0], 0, -1});
    return targets;
  }
  for (size_t i = 0; i < optim_params_.size(); ++i) {
    const at::Tensor& piece = optim_params_[i];
    // See Note [Parameters without gradients].
    if (!piece.requires_grad() || (received != nullptr && !(*received)[i])) continue;
    targets.push_back({piece, flat_->shard_part(i).in_shard, piece.numel()});
  }
  return targets;
}

void UnitRuntime::assign_reduced_grad(const std::vector<bool>* received) {
  std::vector<GradTarget> targets = grad_targets(received);
  const ReducedGradHooks* hooks = grad_hooks();
  if (hooks && !targets.empty()) {
    // On a GPU, left there by finish_reduction (parts_at_end): the last
    // unit of backward (the root's token embedding) is stepped part by part
    // as its copy lands, instead of after the whole copy.
    const auto plan = grad_parts(targets, grad_shard_);
    if (plan.size() > 1) {
      ReducedGrad grad = reduced_grad_for(targets);
      hand_over_in_parts(grad, grad_work_, grad_shard_, std::move(targets), plan,
                         /*parts_seen=*/true, shard_grad_options().dtype().toScalarType(),
                         flat_->shard_pinned(), label());
      hooks->on_reduced(std::move(grad));
      return;
    }
  }
  // Note [Mixed precision], [Shards in host memory]
  set_reduced_grads(targets, grad_for_shard(grad_shard_));
  if (hooks && !targets.empty()) hooks->on_reduced(reduced_grad_for(targets));
}

}  // namespace fsdp::detail
