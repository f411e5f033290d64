#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>
#include <torch/serialize/archive.h>
#include <torch/version.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/core/flat_parameter.h>
#include <fsdp/runtime/exec_order.h>
#include <fsdp/wrap/options.h>

namespace fsdp {

namespace detail {
class UnitInit;
}  // namespace detail

/// The default of Module::zero_grad's set_to_none in this LibTorch (false in
/// 1.13, true from 2.0), which the wrappers' zero_grad overrides repeat.
/// (Public headers cannot include src/detail/torch_compat.h.)
inline constexpr bool kModuleZeroGradSetsToNone = TORCH_VERSION_MAJOR >= 2;

/// The runtime of one FSDP unit: its FlatParameter and the hooks around its
/// module's forward and backward. The typed wrapper
/// (fsdp::FullyShardedDataParallel<Impl>) derives from it.
///
/// Note [FSDP and autograd]
/// C++ modules have no forward hooks, so the wrapper's forward calls
/// pre_forward() and post_forward() itself. Backward is driven by autograd:
/// - a hook on the unit's output (registered in post_forward) fires before the
///   unit's backward runs: it gathers the parameters again (kFullShard) and
///   queues, once per backward, the root's end-of-backward callback;
/// - a post hook on each trainable parameter's AccumulateGrad node moves the
///   gradient into the unit's flat gradient buffer; when the last one arrived
///   the buffer is reduce-scattered (asynchronously) and the unit reshards;
/// - the end-of-backward callback finishes what hooks could not: units whose
///   gradients arrived only in part (unused parameters), waiting for the
///   reduce-scatters, setting the shards' .grad, resharding what is left.
/// The AccumulateGrad nodes are held here: autograd keeps only weak pointers.
class Unit {
 public:
  virtual ~Unit();

  /// Lifecycle of a unit within one iteration (checked transitions).
  enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };

  /// The flat shards of this unit and of every unit nested in it: what an
  /// optimizer steps. Shards of fully frozen units are included (their
  /// requires_grad is false).
  std::vector<at::Tensor> flat_parameters() const;

  /// flat_parameters() with names: with use_orig_params, each original
  /// parameter's path from this unit ("block.0.weight"); otherwise each unit's
  /// path followed by "_flat_param" ("block._flat_param").
  torch::OrderedDict<std::string, at::Tensor> named_flat_parameters() const;

  /// This unit's FlatParameter, or nullptr when it manages no parameter.
  FlatParameter* flat_param() const { return flat_.get(); }
  /// True for the outermost unit (decided at the first forward).
  bool is_root() const { return root_ == this; }
  /// False for a pass-through wrapper (fsdp::wrap() outside a scope): it is
  /// no unit, and its parameters belong to the enclosing unit.
  bool is_active() const { return active_; }
  /// This unit's state.
  TrainingState training_state() const { return state_; }
  /// The unit's options.
  const FSDPOptions& fsdp_options() const { return options_; }
  /// The module this unit (or pass-through wrapper) wraps, when known.
  torch::nn::Module* wrapped_module() const { return wrapped_; }
  /// Refuses to wrap `module` when it is an FSDP unit itself, naming what
  /// that unit wraps (see Note [One unit per parameter]).
  static void check_not_a_unit(const torch::nn::Module& module);

  /// The dtype the floating-point tensor arguments of this unit's forward are
  /// cast to (see MixedPrecision's cast_forward_inputs and
  /// cast_root_forward_inputs, and keep_full_precision()), or nullopt. Valid
  /// from pre_forward() on (the root is known then).
  c10::optional<at::ScalarType> forward_input_dtype() const;
  /// True when the wrapper casts its output back to its inputs' dtype (a
  /// unit kept in full precision inside a mixed-precision model).
  bool casts_output_back() const { return full_precision_override_; }
  /// Makes this unit compute in its parameters' own dtype inside a
  /// mixed-precision model: inputs are cast to it, outputs back (auto_wrap
  /// does this for MixedPrecision::module_classes_to_ignore). Before the
  /// first forward.
  void keep_full_precision() { full_precision_override_ = true; }

  /// Clips the gradients of every shard in this unit's tree so that their
  /// global norm (over all ranks) is at most max_norm; returns that norm
  /// before clipping, the same on every rank. Collective; call on the root
  /// between backward and the optimizer step.
  ///
  /// Use this, not LibTorch's torch::nn::utils::clip_grad_norm_(
  /// model->parameters(), ...): that one sees only this rank's shards, so it
  /// computes a local norm and each rank clips by a different factor (no
  /// error; parameters drift apart from plain training).
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);

  /// Clears the gradients of what the optimizer steps for this unit (its flat
  /// shard, or with use_orig_params its per-parameter views of the shard), as
  /// Module::zero_grad does for parameters: set_to_none drops them (they
  /// become undefined), otherwise they are zeroed in place. The wrappers'
  /// zero_grad() call it; units nested in a unit are reached through
  /// Module::zero_grad's recursion, so model->zero_grad() clears them all.
  void zero_optim_grads(bool set_to_none);

  /// While the returned guard lives, backward passes accumulate gradients
  /// locally (unsharded) and communicate nothing; the first backward after it
  /// reduces everything accumulated. Call on the root.
  class NoSyncGuard {
   public:
    /// Restores gradient synchronisation.
    ~NoSyncGuard();
    NoSyncGuard(NoSyncGuard&& other) noexcept : units_(std::move(other.units_)) {}
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    friend class Unit;
    explicit NoSyncGuard(std::vector<Unit*> units);
    std::vector<Unit*> units_;
  };
  /// See NoSyncGuard.
  NoSyncGuard no_sync();

 protected:
  explicit Unit(FSDPOptions options);

  /// Flattens the parameters of `self` (the wrapper module, whose parameters
  /// and children are the wrapped module's, `wrapped`) that no nested unit
  /// owns, initialising meta ones first (see Note [Deferred initialisation]).
  void init_unit(torch::nn::Module& self, torch::nn::Module* wrapped = nullptr);
  /// Makes this a pass-through (see is_active()) around `wrapped`; instead of
  /// init_unit().
  void deactivate(torch::nn::Module* wrapped = nullptr) {
    active_ = false;
    wrapped_ = wrapped;
  }
  /// Module::save for the wrapper `self`: writes what the unwrapped module
  /// would write (full parameters under their own names, buffers, children),
  /// gathering this unit's full-precision parameters; nested units gather
  /// their own. Collective: every rank saves (see Note [Saving a unit]).
  void save_unit(const torch::nn::Module& self, torch::serialize::OutputArchive& archive) const;
  /// Module::load for the wrapper `self`: reads full parameters as the
  /// unwrapped module would and keeps this rank's part in the shard. Every
  /// rank loads the whole file; no communication.
  void load_unit(torch::nn::Module& self, torch::serialize::InputArchive& archive);
  /// Called by the wrapper before the wrapped forward.
  void pre_forward();
  /// Called by the wrapper after the wrapped forward with the tensors of its
  /// output. `unknown_output_type` (a mangled type name) when the output's
  /// type hides its tensors: then a unit that trains is refused.
  void post_forward(const std::vector<at::Tensor>& outputs,
                    const char* unknown_output_type = nullptr);

 private:
  void lazy_init_root();
  void prefetch_forward();
  void prefetch_backward();
  void pre_backward();
  void on_grad_ready(size_t slot);
  void join_reduction_order();
  void launch_ready_reductions();
  void launch_grad_reduction();
  void finish_reduction();
  void finish_backward(const std::vector<bool>* received);
  void end_of_backward();
  std::vector<std::vector<bool>> agree_received_grads() const;
  void warn_unused_slots();
  void clear_moved_grads();
  void keep_full_precision_classes(
      const std::vector<std::pair<std::string, const torch::nn::Module*>>& modules,
      const std::string& where, int rank);
  void transition(TrainingState from, TrainingState to);
  void register_grad_hooks();
  void make_optim_params();
  void assign_reduced_grad(const std::vector<bool>* received);
  // Defined in unit_precision.cpp (mixed precision and deferred init).
  FlatParamConfig flat_param_config(detail::UnitInit& init) const;
  at::Tensor full_precision_grad(const at::Tensor& reduced) const;
  std::vector<Unit*> units_in_tree() const;

  // Constant after init_unit().
  FSDPOptions options_;
  bool active_ = true;
  std::unique_ptr<FlatParameter> flat_;
  torch::nn::Module* self_ = nullptr;
  torch::nn::Module* wrapped_ = nullptr;
  bool full_precision_override_ = false;  // see keep_full_precision()
  // shared_ptr in LibTorch 1.13, intrusive_ptr in 2.x.
  std::vector<decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()))>
      grad_accumulators_;
  std::vector<bool> slot_trainable_;
  // Per slot: what the original parameter's .grad points at once its
  // gradient moved into flat_grad_ (Note [Sharded placeholders]).
  std::vector<at::Tensor> grad_placeholders_;
  // What the optimizer steps: {shard} or, with use_orig_params, one view of
  // the shard per slot (see Note [FlatParameter vocabulary]).
  std::vector<at::Tensor> optim_params_;
  size_t trainable_slots_ = 0;
  // Whether the warning about parameters without gradients (flat shards)
  // was given; see Note [Parameters without gradients].
  bool warned_unused_ = false;

  // Set at the root's first forward.
  Unit* root_ = nullptr;
  std::vector<Unit*> units_;  // root only: every unit of the tree, pre-order
  // Root only: the first iteration's forward order (units with parameters),
  // agreed across ranks; drives prefetch. See Note [Forward order].
  std::unique_ptr<ExecOrder> exec_order_;

  // Per-iteration state.
  TrainingState state_ = TrainingState::kIdle;
  bool backward_seen_ = false;    // pre-backward hook fired this iteration
  bool require_sync_ = true;      // false inside no_sync()
  bool callback_queued_ = false;  // root only
  // Root only: the units whose forward this iteration can bring gradients,
  // in forward order; their reductions are launched in reverse, the first
  // `reductions_launched_` of them already. See Note [Reduction order].
  std::vector<Unit*> reduction_order_;
  size_t reductions_launched_ = 0;
  size_t grads_ready_ = 0;
  at::Tensor flat_grad_;  // unsharded gradient buffer while accumulating
  // Per slot: holds a gradient in flat_grad_ (Note [Filling the flat gradient]).
  std::vector<bool> slot_filled_;
  at::Tensor grad_shard_;  // reduce-scatter output
  Work grad_work_;         // pending reduce-scatter / all-reduce
};

/// The name of a training state, for messages.
const char* to_string(Unit::TrainingState state);

}  // namespace fsdp
