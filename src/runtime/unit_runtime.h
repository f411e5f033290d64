#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fsdp/comm/work.h>
#include <fsdp/runtime/reduced_grad_hooks.h>
#include <fsdp/runtime/unit.h>

#include "core/flat_parameter.h"
#include "core/sharded_placeholder.h"
#include "runtime/reduced_grad.h"
#include "runtime/strategy.h"
#include "runtime/unit_init.h"

namespace fsdp::detail {

class RootState;
class UnitInit;

// Note [Unit, runtime and root]
// A unit has three jobs, each in its own class:
// - fsdp::Unit (include/fsdp/runtime/unit.h), the handle: what users and the
//   wrappers call (flat_parameters, clip_grad_norm_, no_sync, pre_forward,
//   ...). A pass-through wrapper is a handle without a runtime.
// - UnitRuntime (here), one per active unit: its FlatParameter, its
//   TrainingState with checked transitions, and the hooks that move it
//   through forward and backward (gather, reshard, gradient hooks, the
//   reduction of its gradient).
// - RootState (runtime/root_state.h), owned by the root's runtime from the
//   root's first forward: every unit of the tree, the forward order, the
//   reduction order, the end-of-backward callback.
// Other layers reach the FlatParameter only through the handle, which checks
// that the unit is idle (gather_full_params and friends).
class UnitRuntime final : public ParamUseListener {
 public:
  /// What tells the unit that its forward runs: the wrapper's forward, which
  /// calls pre_forward/post_forward, or the operators on its parameters
  /// (fsdp::fully_shard; see Note [Units driven by dispatch]).
  enum class Driver { kWrapper, kDispatch };

  UnitRuntime(Unit& handle, FSDPOptions options);
  ~UnitRuntime();
  UnitRuntime(const UnitRuntime&) = delete;
  UnitRuntime& operator=(const UnitRuntime&) = delete;

  /// The runtime of `unit`, nullptr for a pass-through (or a non-unit module).
  static UnitRuntime* of(const torch::nn::Module& module);
  /// The runtimes of the units in `model`'s module tree (itself included),
  /// pre-order.
  static std::vector<UnitRuntime*> all_in(const torch::nn::Module& model);

  /// Flattens the parameters of `self` that no nested unit owns.
  void init(torch::nn::Module& self, torch::nn::Module* wrapped, Driver driver = Driver::kWrapper);
  Driver driver() const { return driver_; }

  Unit& handle() const { return handle_; }
  const FSDPOptions& options() const { return options_; }
  FlatParameter* flat() const { return flat_.get(); }
  torch::nn::Module* self() const { return self_; }
  Unit::TrainingState state() const { return state_; }
  /// In an activation_checkpoint() region's forward (else nothing), refuses
  /// a region given this unit's flat shards as params (its forward reads the
  /// originals).
  void refuse_shards_as_checkpoint_params() const;
  /// Module path from the root ("" for the root), known from the root's
  /// first forward.
  const std::string& path() const { return path_; }
  bool is_root() const;
  const std::vector<at::Tensor>& optim_params() const { return optim_params_; }
  bool full_precision_override() const { return full_precision_override_; }
  void keep_full_precision() { full_precision_override_ = true; }
  /// See Unit::set_activation_checkpointing.
  void set_activation_checkpointing(bool on);
  /// See Unit::refuse_activation_checkpointing.
  [[noreturn]] void refuse_activation_checkpointing(const char* output_type) const;
  /// A no_sync() guard over this unit begins (guards nest: synchronisation
  /// comes back when the outermost ends, as PyTorch's no_sync restores).
  void enter_no_sync() { ++no_sync_depth_; }
  /// A no_sync() guard over this unit ends.
  void leave_no_sync() { --no_sync_depth_; }
  /// See Unit::set_requires_gradient_sync: the user's setting, beside the
  /// guards (either one turns synchronisation off).
  void set_requires_gradient_sync(bool on) { requires_gradient_sync_ = on; }
  /// See Unit::set_reshard_after_forward and set_reshard_after_backward
  /// (Note [Resharding as the user says]).
  void set_reshard_after_forward(bool on) { reshard_after_forward_ = on; }
  void set_reshard_after_backward(bool on) { reshard_after_backward_ = on; }
  /// See Unit::set_requires_all_reduce (Note [Accumulating within the node]).
  void set_requires_all_reduce(bool on) { requires_all_reduce_ = on; }
  /// See Unit::set_unshard_in_backward (Note [Units backward does not gather]).
  void set_unshard_in_backward(bool on) { unshard_in_backward_ = on; }
  /// See Unit::set_gradient_divide_factor (Note [A gradient divide factor]).
  void set_gradient_divide_factor(std::optional<double> factor) {
    gradient_divide_factor_ = factor;
  }
  /// Unit::unshard: starts a gather (and waits for it unless `async_op`);
  /// returns the number of the gather the unit holds or awaits.
  uint64_t unshard_for_user(bool async_op);
  /// Unit::UnshardHandle::wait for the gather numbered `gather`.
  void wait_for_user_gather(uint64_t gather);
  /// Unit::reshard.
  void reshard_for_user();
  /// Unit::set_modules_to_forward_prefetch / set_modules_to_backward_prefetch.
  void set_prefetch_targets(const std::vector<Unit*>& units, bool backward);
  /// Expires with the runtime (what an UnshardHandle checks).
  std::weak_ptr<const void> alive() const { return alive_; }
  /// False inside no_sync() or after set_requires_gradient_sync(false):
  /// gradients accumulate unsharded, unreduced.
  bool require_sync() const { return no_sync_depth_ == 0 && requires_gradient_sync_; }
  /// True once the root's first forward made another unit this one's root.
  bool is_inner() const { return root_ != nullptr && !is_root(); }
  /// "FSDP unit '<path>'", for messages.
  std::string label() const;
  /// The name of the module it wraps (else of the wrapper), for messages.
  std::string module_name() const;

  // Forward and backward (see Note [FSDP and autograd]).
  // A forward or backward through a unit SummonFullParams summoned into a
  // buffer of its own is an error (Note [Summoning in full precision]).
  void refuse_if_summoned(const char* pass) const;
  void pre_forward();
  void post_forward(const std::vector<at::Tensor>& outputs, const char* unknown_output_type);
  // See Note [Parameters backward reads without a gradient].
  void record_forward_inputs(const std::vector<at::Tensor>& inputs, bool all_found);

  // Units driven by dispatch (Note [Units driven by dispatch]).
  void hold_for_operator() override;
  void before_param_use(bool sharded) override;
  void param_use_arguments(c10::ArrayRef<c10::IValue> args) override;
  void after_param_use(c10::ArrayRef<c10::IValue> outputs, bool wrote) override;
  // An operator wrote to the gathered parameters: each rank keeps its part.
  void write_back(c10::ArrayRef<c10::IValue> outputs);
  void moved_grad_detached(const at::Tensor& grad) override;
  void moved_grad_zeroed(const at::Tensor& grad) override;
  at::Tensor moved_grad_norm(const at::Tensor& grad, double p) override;
  void write_moved_grad(const at::Tensor& grad,
                        const std::function<void(const at::Tensor& part)>& write) override;
  bool load_param(const at::Tensor& param, const at::Tensor& value) override;
  c10::optional<at::ScalarType> compute_dtype() const override;
  bool holds_buffer(const at::Tensor& t) const override;

  // Outside forward and backward (see Unit::gather_full_params).
  bool gather_full_params(bool to_cpu, bool with_grads);
  // See Note [Nested summons].
  bool held_by_summon_guard() const { return summon_guard_ == SummonGuard::kHeld; }
  void enter_summon_guard();
  void leave_summon_guard();
  void release_full_params();
  // Gathered for a graph a backward with create_graph built, which may still
  // be differentiated (Note [Double backward]).
  bool held_for_graph() const;
  // Such a unit's parameters gathered again in place from the shards (which
  // an optimizer step may have changed). Collective.
  void refresh_gathered();
  // Whether what this unit holds gathered may be older than its shards: a
  // step, a load or a clearing of its gradients came since it gathered
  // (Note [Gathered before a step]).
  bool gathered_may_be_stale() const;
  // Frees what an earlier forward left gathered, where it may be stale, at
  // the start of the next: not what a graph, a SummonFullParams or another
  // unit's operator holds.
  void reshard_left_gathered();
  void write_back_full_params();
  // Note [Summoning gradients]: while summoned with them, the full gradients
  // and each parameter's .grad from before.
  void summon_grads();
  void release_grads();

  void zero_optim_grads(bool set_to_none);
  // zero_optim_grads' parts: waiting for an optimizer that steps the
  // gradients as they land (ReducedGradHooks::before_zero_grad), and the
  // clearing itself (for libfsdp's own use where none can be stepping).
  void wait_for_grad_users() const;
  void clear_optim_grads(bool set_to_none);
  c10::optional<at::ScalarType> forward_input_dtype() const;

  /// Where the reduced shard goes: the optimizer tensors that get it (each
  /// with its part of the shard), given which slots received a gradient on
  /// any rank (null: all).
  std::vector<GradTarget> grad_targets(const std::vector<bool>* received) const;
  /// See fsdp::set_reduced_grad_hooks; null removes them.
  void set_grad_hooks(std::shared_ptr<const ReducedGradHooks> hooks) {
    grad_hooks_ = std::move(hooks);
  }
  /// The hooks installed, or null: none, or their listener has gone
  /// (ReducedGradHooks::listening).
  const ReducedGradHooks* grad_hooks() const {
    if (!grad_hooks_ || (grad_hooks_->listening && !grad_hooks_->listening())) return nullptr;
    return grad_hooks_.get();
  }
  /// Before the unit's state is read or written outside forward and
  /// backward: the listener's ReducedGradHooks::before_state_use, if any.
  void before_state_use() const {
    const ReducedGradHooks* hooks = grad_hooks();
    if (hooks && hooks->before_state_use) hooks->before_state_use();
  }

 private:
  friend class RootState;
  void transition(Unit::TrainingState to);
  void remember_cast_buffers(std::vector<CastBuffer> cast);
  void abandon_iteration();
  // pre_forward once the root is known: enters the forward state, gathers.
  void begin_forward_state();
  // A dispatch-driven unit's post_forward; `keep`: stay gathered (backward
  // needs this unit first).
  void end_dispatched_forward(bool keep);
  // The first use of a dispatch-driven unit: the outermost unit made in place
  // around it becomes the root.
  void become_rooted();
  // Its root is gone (Note [A model's units outlive it]): no root, no
  // enclosing unit, idle; the next use roots it anew.
  void orphan();
  // Dispatch-driven units still in a forward that nothing ended (no backward
  // followed) end it before they are used from outside.
  void end_open_forward();
  // Ends a dispatch-driven forward that nothing ended, then checks that the
  // unit is idle (an error naming `what` otherwise).
  void check_idle(const char* what);
  // This unit as the listener of its parameters' uses, or nullptr for a
  // wrapper's unit (see Note [Units driven by dispatch]).
  ParamUseListener* use_listener() { return driver_ == Driver::kDispatch ? this : nullptr; }
  // See Note [A unit's collectives]: kSharded -> kUnsharding, for a
  // prefetch or for unshard() (Note [Copy-in on a stream of its own]).
  void unshard_async(bool prefetch);
  // Counts a gather as it begins, and records grads_at_gather_.
  void mark_gather();
  // -> kUnsharded: waits for the pending all-gather, or gathers now.
  void unshard();
  // Whether the unit frees its gathered parameters where its forward ends;
  // `backward_follows`: its outputs were hooked for a backward (Note
  // [Resharding as the user says]).
  bool frees_after_forward(bool backward_follows) const;
  // reshard() where backward frees the unit (its reduction launched, its
  // frozen reads over, the end of backward), unless the user keeps it.
  void reshard_in_backward();
  // Refuses the user's `what` (unshard, reshard) inside SummonFullParams.
  void check_user_resharding(const char* what) const;
  // -> kSharded where the buffer is freed, unless held for a built graph
  // (Note [Double backward]); a pending all-gather is waited for first (it
  // writes into the buffer).
  void reshard();
  // reshard()'s freeing, whatever holds the unit gathered: the buffer's
  // memory held or released as Note [Copy-in on a stream of its own] says.
  void free_unsharded();
  // kUnsharding -> kUnsharded: waits for pending_gather_.
  void wait_pending_gather();
  // Starts this unit's gather ahead of its use, where it is idle, sharded
  // and no SummonFullParams guard's: what every prefetch does.
  void prefetch();
  void prefetch_forward();
  // prefetch() of the user's prefetch targets still alive.
  struct PrefetchTarget {
    UnitRuntime* unit;
    std::weak_ptr<const void> alive;  // the target's alive()
  };
  void prefetch_targets(const std::vector<PrefetchTarget>& targets);
  /// Sets each original parameter's requires_grad for this forward and
  /// counts the trainable ones.
  void prepare_slots();
  // With flat shards: whether the unit trains, its shard's flag, which
  // follows the module's own parameters where the user set theirs since
  // they were last given it (Note [Freezing after wrapping]); records what
  // prepare_slots gives them now.
  bool follow_parameters_frozen_by_user();
  /// Registers pre_backward on each output that requires a gradient;
  /// returns whether there was one.
  bool hook_outputs(const std::vector<at::Tensor>& outputs);
  /// hook_outputs for one output.
  bool hook_output(const at::Tensor& output);
  void prefetch_backward();
  void pre_backward();
  // Note [Parameters backward reads without a gradient]: whether the unit has
  // parameters backward may read without computing their gradient (frozen
  // ones) in a buffer it frees; a gradient of one of the inputs hooked since
  // the last backward ended was computed (from the hooks of `epoch`); the
  // end of a backward, or of an abandoned iteration, forgets them.
  bool has_frozen_reads() const;
  void input_grad_computed(uint64_t epoch);
  void forget_forward_inputs();
  // See Note [Gradients a backward computes].
  void expect_grads_of_this_backward();
  // One of this backward's gradients arrived: the reduction launches once
  // all it computes have.
  void note_grad_arrived();
  // Launches the reduction (in its order) once every gradient expected
  // arrived.
  void launch_if_complete();
  void on_grad_ready(size_t slot);
  void launch_grad_reduction();
  // What a backward counted and held, as none began: when it ends, or
  // stopped midway (abandon_iteration).
  void reset_backward_progress();
  // This backward's reduction launched: in flight, or handed over early.
  bool reduction_launched() const { return grad_work_ || delivered_early_; }
  // Whether a reduction launched now would stay within the node (Note
  // [Accumulating within the node]).
  bool reduces_within_node_only() const;
  // Adds the reduction that stayed within the node to what is kept.
  void keep_within_node();
  // Drops what is kept within the node: all of it, or slot i's part (the
  // user cleared those gradients).
  void forget_within_node();
  void forget_within_node_slot(size_t i);
  /// Launches what is left of this backward's reduction and makes the
  /// compute stream wait for it; true when it also queued the reduced
  /// shard's copy to host memory (Note [Gradients to host memory]).
  bool finish_reduction();
  /// Ends this backward: sets the reduced gradient (`received`: the agreed
  /// slots, null for all); `reduced` false keeps an unreduced gradient for
  /// the next backward (Note [Backward with respect to inputs]).
  void finish_backward(const std::vector<bool>* received, bool reduced);
  void warn_unused_slots();
  void clear_moved_grads();
  // Note [Gradients the user clears]: what the optimizer steps loses the
  // parts whose .grad the user took away since the last backward showed it.
  void drop_grads_the_user_dropped();
  // At the end of a backward: each slot that has a gradient shows its
  // placeholder, kHidden ones and, when it `reduced`, those it `received`
  // (the agreed slots, null for all).
  void show_moved_grads(bool reduced, const std::vector<bool>* received);
  // The slot whose moved gradient `grad` is (or a copy of), if any.
  c10::optional<size_t> slot_of_moved_grad(const at::Tensor& grad) const;
  // This rank's part of slot i's gradient in what the optimizer steps (1-D,
  // possibly empty); undefined where that holds no gradient.
  at::Tensor moved_grad_part(size_t i) const;
  // Runs `write` on that part, or, where this rank holds none of it, moves
  // the gradient's version as the writes on the other ranks do.
  void write_slot_grad(size_t i, const std::function<void(const at::Tensor& part)>& write);
  // Refuses `what` of a moved gradient under steps during backward, whose
  // gradients were stepped already (as Unit::clip_grad_norm_ refuses).
  void check_moved_grads_unstepped(const char* what) const;
  // Slot i's part of what the optimizer steps zeroed in place.
  void zero_slot_grad(size_t i);
  // The parts of the slots in `dropped` dropped (a flat shard's part can
  // only be zeroed; the whole shard's gradient goes when no part is kept).
  void drop_slot_grads(const std::vector<bool>& dropped);
  void keep_full_precision_classes(
      const std::vector<std::pair<std::string, const torch::nn::Module*>>& modules,
      const std::string& where, int rank);
  void register_grad_hooks();
  void make_optim_params();
  // Sets the optimizer tensors' .grad from the reduced shard and tells the
  // hooks.
  void assign_reduced_grad(const std::vector<bool>* received);
  // Whether this backward's gradient, its reduction just launched, is final
  // (Note [Steps during backward]).
  bool can_deliver_early() const;
  // Hands the launched reduction to the hooks, to be completed by them.
  void deliver_early();
  // What the hooks are told of `targets` (complete() left to the caller):
  // for the unit the next forward unshards first, under offload, also what
  // sends each stepped range on to the device (Note [Copy-in at the step]).
  ReducedGrad reduced_grad_for(const std::vector<GradTarget>& targets);
  // The parts in which `reduced`, the gradient of `targets`, goes to hooks
  // that take parts (Note [Stepping a gradient as it lands]): one or none
  // where it goes whole.
  std::vector<std::vector<ParamRange>> grad_parts(const std::vector<GradTarget>& targets,
                                                  const at::Tensor& reduced) const;
  // Whether this unit's reduced gradient, still on the GPU at the end of
  // backward, goes to the hooks in parts, its copy to host memory left to
  // them.
  bool parts_at_end() const;
  // Under CPU offload, a reduction just launched on the GPU (NCCL) during
  // backward: its result's copy to host memory can be queued now, on the
  // copy-out stream (Note [Gradients to host memory]).
  bool can_copy_out_early() const;
  void copy_out_early();
  // Lets go of the reduced shard on the GPU once copy_out_early's copy of it
  // has run, waiting for it where `wait`; true when none is held any more.
  bool release_copied_out(bool wait);
  // `reduced` (on the GPU) copied into new pinned host memory in the shard's
  // gradient dtype, queued on the current stream (Note [Gradients to host
  // memory]): copy_out_early's, and finish_reduction's for the others.
  at::Tensor start_grad_copy_to_host(const at::Tensor& reduced) const;
  // Defined in unit_precision.cpp (mixed precision, CPU offload, deferred init).
  FlatParamConfig flat_param_config(UnitInit& init, c10::Device device);
  // The reduced gradient as the shard's .grad takes it: in the shard's dtype
  // (unless keep_low_precision_grads) and in the shard's memory.
  at::Tensor grad_for_shard(const at::Tensor& reduced) const;
  // Where and in which dtype grad_for_shard puts a reduced gradient.
  at::TensorOptions shard_grad_options() const;
  RootState& root() const;

  // Constant after init().
  Unit& handle_;
  FSDPOptions options_;  // process_group(): the whole job's group, set in init()
  std::unique_ptr<FlatParameter> flat_;
  // Hybrid strategies: the group each shard is all-reduced across
  // (Note [Hybrid sharding]); nullptr otherwise.
  std::shared_ptr<ProcessGroup> replicate_group_;
  torch::nn::Module* self_ = nullptr;
  // A unit made in place watches its module (Note [A model's units outlive
  // it]); empty for a wrapper, which is its module.
  std::weak_ptr<torch::nn::Module> self_alive_;
  // self_'s buffers (recursively) as holds_buffer() listed them in this
  // forward (anew in each: a buffer may be replaced between forwards), held
  // so that no other tensor takes the address of one.
  struct ListedBuffers {
    std::vector<at::Tensor> held;
    std::unordered_set<const c10::TensorImpl*> impls;
  };
  mutable c10::optional<ListedBuffers> buffers_listed_;
  Driver driver_ = Driver::kWrapper;
  bool full_precision_override_ = false;  // see Unit::keep_full_precision()
  std::vector<CastBuffer> cast_buffers_;  // registered for saved_buffer_dtype()
  // shared_ptr in LibTorch 1.13, intrusive_ptr in 2.x.
  std::vector<decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()))>
      grad_accumulators_;
  // With use_orig_params, the requires_grad prepare_slots last gave each
  // parameter (Note [Freezing after wrapping]).
  std::vector<bool> params_given_;
  // The requires_grad prepare_slots last gave the parameters of a unit with
  // flat shards (one for all; its shard's when wrapped).
  bool params_trainable_ = true;
  // Per slot: what the original parameter's .grad points at once its
  // gradient moved into flat_grad_ (Note [Sharded placeholders]).
  std::vector<at::Tensor> grad_placeholders_;
  // Per slot, what its .grad shows of the gradient the optimizer steps
  // (Note [Gradients the user clears]). kNone -> kShown (a backward set its
  // placeholder) -> kDetached (Module::zero_grad detached it) -> kShown (the
  // copy zeroed) or kDropped (every shown one detached: dropped) -> kShown
  // (a dropped one's copy zeroed: zeros back). When a backward begins (its
  // gradients must not meet a placeholder) a shown one -> kHidden, shown
  // again at its end (-> kShown), any other -> kNone.
  enum class MovedGrad { kNone, kShown, kDetached, kDropped, kHidden };
  // The slot's .grad is its placeholder (or Module::zero_grad's copy of it).
  static bool shows(MovedGrad m) { return m == MovedGrad::kShown || m == MovedGrad::kDetached; }
  std::vector<MovedGrad> moved_grads_;
  // The options of each optimizer tensor's gradient the last kDropped drop
  // took (nullopt: had none): a zeroed copy gets zeros of these back.
  std::vector<c10::optional<at::TensorOptions>> dropped_grad_options_;
  at::Tensor summoned_grads_;  // see Note [Summoning gradients]
  // Whether a SummonFullParams guard holds the unit, on every rank alike
  // whatever this rank gathered (Note [Nested summons]).
  enum class SummonGuard { kNone, kHeld };
  SummonGuard summon_guard_ = SummonGuard::kNone;
  std::vector<at::Tensor> grads_before_summon_;
  // What the optimizer steps: {shard} or, with use_orig_params, one view of
  // the shard per slot (see Note [FlatParameter vocabulary]).
  std::vector<at::Tensor> optim_params_;
  // Whether the warning about parameters without gradients (flat shards)
  // was given; see Note [Parameters without gradients].
  bool warned_unused_ = false;

  // Set at the root's first forward: the root's state (owned by the root)
  // and this unit's path from the root.
  RootState* root_ = nullptr;
  std::string path_;
  // The nearest unit whose module holds this one's (nullptr for the root).
  UnitRuntime* enclosing_ = nullptr;
  std::unique_ptr<RootState> owned_root_;

  // Per-iteration state.
  Unit::TrainingState state_ = Unit::TrainingState::kIdle;
  int no_sync_depth_ = 0;               // no_sync() guards alive over this unit
  bool requires_gradient_sync_ = true;  // Unit::set_requires_gradient_sync
  // Unit::set_reshard_after_forward (nullopt: the strategy decides) and
  // set_reshard_after_backward.
  std::optional<bool> reshard_after_forward_;
  bool reshard_after_backward_ = true;
  bool requires_all_reduce_ = true;               // Unit::set_requires_all_reduce
  bool unshard_in_backward_ = true;               // Unit::set_unshard_in_backward
  std::optional<double> gradient_divide_factor_;  // Unit::set_gradient_divide_factor
  uint64_t gathers_ = 0;  // gathers begun (mark_gather): the one an UnshardHandle awaits
  // Unit::set_modules_to_forward_prefetch and set_modules_to_backward_prefetch.
  std::vector<PrefetchTarget> forward_targets_, backward_targets_;
  const std::shared_ptr<const char> alive_ = std::make_shared<const char>();
  size_t trainable_slots_ = 0;
  size_t grads_ready_ = 0;  // gradients arrived in this backward
  // Of the trainable slots, those this backward computes a gradient for
  // (Note [Gradients a backward computes]); trainable_slots_ unless known.
  size_t grads_expected_ = 0;
  // Note [Parameters backward reads without a gradient]: kPending from
  // pre_backward while this backward may still read frozen parameters, which
  // reshard() leaves gathered until then.
  enum class FrozenReads { kNone, kPending };
  FrozenReads frozen_reads_ = FrozenReads::kNone;
  // Whether this backward gathered the unit's parameters (Note [Units
  // backward does not gather]); kNone again when backward ends.
  enum class BackwardGather { kNone, kGathered };
  BackwardGather backward_gather_ = BackwardGather::kNone;
  // This iteration's forward inputs that require a gradient, hooked (none
  // when some argument's tensors could not be found), of which
  // inputs_reached_ got theirs in this backward; hooks of an older
  // input_epoch_ are ignored.
  std::optional<size_t> inputs_hooked_ = 0;
  size_t inputs_reached_ = 0;
  uint64_t input_epoch_ = 0;
  // The hooks on leaf inputs, removed when the inputs are forgotten.
  std::vector<std::pair<at::Tensor, unsigned>> leaf_input_hooks_;
  // When this iteration's forward first entered the unit: its place in the
  // reduction order (Note [Reduction order]).
  size_t forward_position_ = 0;
  // Dispatch-driven: an output of this forward got the pre-backward hook
  // (what a wrapper's post_forward learns from its outputs).
  bool hooked_ = false;
  // Dispatch-driven: held gathered for the operator being reported
  // (ParamUseListener::hold_for_operator), and whether its forward ended
  // meanwhile, so it reshards once the operator ran.
  enum class OperatorHold { kNone, kHeld, kReshardAfter };
  OperatorHold operator_hold_ = OperatorHold::kNone;
  at::Tensor flat_grad_;  // unsharded gradient buffer while accumulating
  // Per slot: holds a gradient in flat_grad_ (Note [Filling the flat gradient]).
  std::vector<bool> slot_filled_;
  // The stream its last forward ran on, on a GPU (Note [The stream of a
  // gradient's hook]).
  std::optional<c10::Stream> forward_stream_;
  at::Tensor grad_shard_;  // reduce-scatter output (after copy_out_early: its host copy)
  Work grad_work_;         // pending reduce-scatter / all-reduce
  // Note [Accumulating within the node]: how far grad_work_ reduces (kNode:
  // into within_node_grad_, not .grad); the sum of the node averages kept
  // from backwards without the cross-node all-reduce (undefined: none), and
  // per slot whether any of them had a gradient here.
  enum class GradReach { kJob, kNode };
  GradReach grad_reach_ = GradReach::kJob;
  at::Tensor within_node_grad_;
  std::vector<bool> within_node_filled_;
  // A backward kept gradients within the node since the last reduction that
  // crossed the nodes: the same on every rank (those reductions are
  // collective), unlike within_node_grad_, which a rank's own clearing of
  // gradients drops. RootState::end_of_backward launches by it.
  bool kept_within_node_ = false;
  // copy_out_early queued the copy of the reduced shard into grad_shard_
  // (host memory) on the copy-out stream: the host waits for that stream
  // before reading it (RootState::end_of_backward).
  enum class CopyOut { kNone, kQueued };
  CopyOut copy_out_ = CopyOut::kNone;
  // The reduced shard on the GPU while the copy-out stream reads it, and the
  // event after that read: released as soon as the event has passed
  // (release_copied_out), not at the end of backward, so that the GPU does
  // not hold every unit's reduced gradient at once (at world 1, the model's).
  at::Tensor grad_on_device_;
  c10::optional<c10::Event> copied_out_;
  Work pending_gather_;  // the all-gather started by unshard_async()
  // What gathered_may_be_stale() compares: each optimizer tensor's .grad
  // (held weakly: a freed one's address is not reused meanwhile; none where
  // undefined) and its version, and grad_clears_, when the last gather began.
  using WeakGrad = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct GradMark {
    WeakGrad grad;
    int64_t version;
  };
  std::vector<std::optional<GradMark>> grads_at_gather_;
  uint64_t clears_at_gather_ = 0;
  // The user's clearings of this unit's gradients through its parameters
  // (Note [Gradients the user clears]): the same on every rank.
  uint64_t grad_clears_ = 0;
  // This backward's reduction went to the hooks when it was launched
  // (deliver_early); finish_backward has nothing left to set.
  bool delivered_early_ = false;
  // See fsdp::set_reduced_grad_hooks.
  std::shared_ptr<const ReducedGradHooks> grad_hooks_;
};

/// The dtype `buffer` is saved in where it is not its own: its dtype before
/// a unit cast it to MixedPrecision::buffer_dtype (see CastBuffer).
c10::optional<at::ScalarType> saved_buffer_dtype(const at::Tensor& buffer);

}  // namespace fsdp::detail
