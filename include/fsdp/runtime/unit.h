#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>
#include <torch/serialize/archive.h>
#include <torch/version.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/runtime/options.h>

namespace fsdp {

class FlatParameter;  // src/core/flat_parameter.h (internal)

namespace detail {
class UnitRuntime;
class RootState;
}  // namespace detail

/// The default of Module::zero_grad's set_to_none in this LibTorch (false in
/// 1.13, true from 2.0), which the wrappers' zero_grad overrides repeat.
/// (Public headers cannot include src/detail/torch_compat.h.)
inline constexpr bool kModuleZeroGradSetsToNone = TORCH_VERSION_MAJOR >= 2;

/// An FSDP unit as its wrapper and its users see it: the handle. The typed
/// wrapper (fsdp::FullyShardedDataParallel<Impl>) and the Sequential entry
/// wrapper derive from it. The unit's training state, its FlatParameter and
/// its hooks live in detail::UnitRuntime, the root's state (all units, the
/// forward order, the reduction order) in detail::RootState; see Note [Unit,
/// runtime and root] in src/runtime/unit_runtime.h.
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
/// The AccumulateGrad nodes are held by the runtime: autograd keeps only weak
/// pointers. A backward with create_graph finishes with the one through the
/// graph it built (Note [Double backward], src/runtime/root_state.cpp).
class Unit {
 public:
  virtual ~Unit();
  Unit(const Unit&) = delete;
  Unit& operator=(const Unit&) = delete;

  /// Lifecycle of a unit within one iteration (checked transitions):
  /// kIdle -> kForward -> kIdle -> kPreBackward -> kPostBackward -> kIdle.
  enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };

  /// The flat shards of this unit and of every unit nested in it, then the
  /// parameters no unit in its tree manages (FSDPOptions::ignored_modules'):
  /// what an optimizer steps, as PyTorch's FSDP's parameters(). Shards of
  /// fully frozen units are included (their requires_grad is false).
  /// `recurse` false: only what this unit manages (its shard, or its
  /// parameters' pieces), not the units inside it, and the unmanaged
  /// parameters registered on its module itself.
  std::vector<at::Tensor> flat_parameters(bool recurse = true) const;

  /// flat_parameters() with names: with use_orig_params, each original
  /// parameter's path from this unit ("block.0.weight"); otherwise each unit's
  /// path followed by "_flat_param" ("block._flat_param"); an unmanaged
  /// parameter's path from this unit.
  torch::OrderedDict<std::string, at::Tensor> named_flat_parameters() const;

  /// Internal (libfsdp's own layers and tests, which include
  /// src/core/flat_parameter.h): this unit's FlatParameter, or nullptr when
  /// it manages no parameter or is a pass-through.
  FlatParameter* flat_param() const;
  /// True for the outermost unit (decided at the first forward).
  bool is_root() const;
  /// False for a pass-through wrapper (fsdp::wrap() outside a scope): it is
  /// no unit, and its parameters belong to the enclosing unit.
  bool is_active() const { return runtime_ != nullptr; }
  /// This unit's state (kIdle for a pass-through).
  TrainingState training_state() const;
  /// The unit's options. Not for a pass-through (is_active() false).
  const FSDPOptions& fsdp_options() const;
  /// The module this unit (or pass-through wrapper) wraps, when known.
  torch::nn::Module* wrapped_module() const { return wrapped_; }
  /// Refuses to wrap `module` when it is an FSDP unit itself (a wrapper, or a
  /// module made a unit by fully_shard), naming what that unit wraps (see
  /// Note [One unit per parameter]).
  static void check_not_a_unit(const torch::nn::Module& module);

  /// The dtype the floating-point tensor arguments of this unit's forward are
  /// cast to (see MixedPrecision's cast_forward_inputs and
  /// cast_root_forward_inputs, and keep_full_precision()), or nullopt. Valid
  /// from pre_forward() on (the root is known then).
  c10::optional<at::ScalarType> forward_input_dtype() const;
  /// True when the wrapper casts its output back to its inputs' dtype (a
  /// unit kept in full precision inside a mixed-precision model).
  bool casts_output_back() const;
  /// The dtype the wrapper casts its output's floating-point tensors to:
  /// `inputs_dtype` (its inputs') where casts_output_back(), else
  /// MixedPrecision::output_dtype; nullopt: none.
  c10::optional<at::ScalarType> forward_output_dtype(
      c10::optional<at::ScalarType> inputs_dtype) const;
  /// Makes this unit compute in its parameters' own dtype inside a
  /// mixed-precision model: inputs are cast to it, outputs back (auto_wrap
  /// does this for MixedPrecision::module_classes_to_ignore). Before the
  /// first forward.
  void keep_full_precision();

  /// Whether the wrapper runs the wrapped forward under
  /// fsdp::activation_checkpoint() (FSDPOptions::activation_checkpointing).
  bool checkpoints_activations() const;
  /// Turns activation checkpointing of the wrapped forward on or off: its
  /// activations are not kept but recomputed in backward, after the unit's
  /// pre-backward gathered its parameters (no extra all-gather). Before a
  /// forward, not inside one. See Note [Activation checkpointing].
  void set_activation_checkpointing(bool on);

  /// Clips the gradients of every shard in this unit's tree so that their
  /// global norm (over all ranks) is at most max_norm; returns that norm
  /// before clipping, the same on every rank. Collective; call on the root
  /// between backward and the optimizer step.
  ///
  /// LibTorch's torch::nn::utils::clip_grad_norm_ works on the original
  /// parameters (a fully_shard model's parameters(), a wrapper's
  /// named_parameters().values()): their moved gradients answer for the
  /// whole gradient (Note [LibTorch's clipping of a unit made in place]).
  /// Not on the flat shards (a wrapper's parameters(), flat_parameters()):
  /// there it sees only this rank's part, computes a local norm and each
  /// rank clips by a different factor (no error; parameters drift apart).
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);

  /// Clears the gradients of what the optimizer steps for this unit (its flat
  /// shard, or with use_orig_params its per-parameter views of the shard), as
  /// Module::zero_grad does for parameters: set_to_none drops them (they
  /// become undefined), otherwise they are zeroed in place. The wrappers'
  /// zero_grad() call it; units nested in a unit are reached through
  /// Module::zero_grad's recursion, so model->zero_grad() clears them all.
  void zero_optim_grads(bool set_to_none);

  /// Outside forward and backward (checked: an error names the unit and its
  /// state): makes the original parameters hold the full values, gathering
  /// them when sharded. Returns whether it gathered (then release_full_params()
  /// frees them again). Collective when it gathers. Used by SummonFullParams
  /// and the state dicts. `to_cpu`: a sharded unit on a GPU holds them in
  /// host memory (SummonOptions::offload_to_cpu); `with_grads`: each
  /// parameter's .grad holds its full gradient too (SummonOptions::with_grads).
  bool gather_full_params(bool to_cpu = false, bool with_grads = false);
  /// Whether a SummonFullParams guard holds this unit, on every rank alike
  /// (with rank0_only too): a guard nested in it, and a state dict taken in
  /// it, leave the unit as the outer guard made it; forward and backward
  /// through it are refused.
  bool held_by_summon_guard() const;
  /// SummonFullParams' start and end of holding this unit (checked: a unit is
  /// held by one guard at a time).
  void enter_summon_guard();
  /// See enter_summon_guard().
  void leave_summon_guard();
  /// Outside forward and backward (checked): frees the full values again,
  /// when this unit frees them at all (not NO_SHARD in full precision), and
  /// gives the parameters back the gradients they had before.
  void release_full_params();
  /// Called before libfsdp reads or writes this unit's state outside forward
  /// and backward (state dicts, SummonFullParams): the error, where an
  /// optimizer stepping during backward has stepped some units and step()
  /// has not come yet (Note [Steps during backward]).
  void before_state_use() const;
  /// Outside forward and backward (checked): copies this rank's part of the
  /// full parameters (modified in place while gathered) into its shard, and
  /// of their full gradients into the shard's gradients where they were
  /// gathered too.
  void write_back_full_params();

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
  /// PyTorch FSDP2's set_requires_gradient_sync: false makes the backward
  /// passes that follow accumulate gradients as inside no_sync(), until it is
  /// set true again; the first backward after that reduces everything
  /// accumulated. Covers every unit of this one's tree; call it on the root,
  /// between iterations (typically `set_requires_gradient_sync(last_micro_batch)`).
  void set_requires_gradient_sync(bool requires_gradient_sync);
  /// PyTorch FSDP2's set_reshard_after_forward: whether the unit frees its
  /// gathered parameters when its forward ends, in place of what its
  /// strategy decides (FULL_SHARD and HYBRID_SHARD free them, SHARD_GRAD_OP
  /// keeps them for backward, the root keeps its own, and a forward without
  /// grad mode frees them). false keeps them gathered after every forward,
  /// evaluation's included (an evaluation loop then gathers once; call
  /// reshard() after it, or set true again); true makes the root free its
  /// own too. A forward after an optimizer step still gathers anew (Note
  /// [Gathered before a step]). `recurse`: every unit of this one's tree.
  /// No effect on NO_SHARD in full precision, which never frees them.
  void set_reshard_after_forward(bool reshard_after_forward, bool recurse = true);
  /// PyTorch FSDP2's set_reshard_after_backward: false keeps the unit's
  /// parameters gathered after a backward that does not synchronise
  /// gradients (no_sync(), set_requires_gradient_sync(false)), so that the
  /// next forward gathers nothing: gradient accumulation, more memory for
  /// fewer all-gathers. A backward that synchronises frees them all the same
  /// (unlike FSDP2): the step that follows it changes the shards, LibTorch's
  /// SGD without a sign that they changed. `recurse`: every unit of this
  /// one's tree. See Note [Resharding as the user says].
  void set_reshard_after_backward(bool reshard_after_backward, bool recurse = true);
  /// PyTorch FSDP2's set_requires_all_reduce, for HYBRID_SHARD and
  /// _HYBRID_SHARD_ZERO2: false makes the backwards that follow
  /// reduce-scatter each gradient within the node only, into a sum the unit
  /// keeps, and leave .grad as it is; the next backward with it true
  /// all-reduces that sum with its own gradient across the nodes and sets
  /// .grad as usual. Gradient accumulation whose memory stays sharded (unlike
  /// set_requires_gradient_sync(false)) and whose cross-node traffic comes
  /// once (typically `set_requires_all_reduce(last_micro_batch)`). No effect
  /// on other strategies. `recurse`: every unit of this one's tree. See Note
  /// [Accumulating within the node].
  void set_requires_all_reduce(bool requires_all_reduce, bool recurse = true);
  /// PyTorch FSDP2's set_gradient_divide_factor (formerly
  /// set_reduce_scatter_divide_factor): this unit's reduced gradient becomes
  /// the ranks' sum divided by `factor` (a positive, finite number) instead
  /// of their average; 1 sums them (a loss summed over the global batch).
  /// Applies to this unit only, as in FSDP2; `recurse`: every unit of its
  /// tree. See Note [A gradient divide factor].
  void set_gradient_divide_factor(double factor, bool recurse = false);
  /// PyTorch FSDP2's set_unshard_in_backward, for units made by fully_shard:
  /// false skips the all-gather this unit makes (or prefetches) where
  /// backward reaches it, for units whose backward does not read their
  /// parameters (an Embedding's weight gradient needs only the indices):
  /// one all-gather less per step (activation checkpointing's recomputation
  /// reads them). Should its backward read them after all, that read
  /// gathers them then (so results do not change). Applies to this
  /// unit only, as in FSDP2. Refused on a FullyShardedDataParallel wrapper,
  /// whose backward reads its parameters unseen. See Note [Units backward
  /// does not gather].
  void set_unshard_in_backward(bool unshard_in_backward);

  /// PyTorch FSDP2's set_modules_to_forward_prefetch: when this unit's
  /// forward begins, after its own gather, it starts the gathers of `units`
  /// that are sharded, in that order (each unit's forward waits for its
  /// own), beside FSDPOptions::forward_prefetch's. Replaces the last list;
  /// empty: none. A unit gone by then is skipped. Every rank alike.
  void set_modules_to_forward_prefetch(const std::vector<Unit*>& units);
  /// PyTorch FSDP2's set_modules_to_backward_prefetch: when this unit's
  /// backward begins, it starts the gathers of `units` that are sharded, in
  /// that order, instead of the one FSDPOptions::backward_prefetch chooses.
  /// Replaces the last list; empty: FSDPOptions::backward_prefetch's again.
  void set_modules_to_backward_prefetch(const std::vector<Unit*>& units);

  /// What unshard(async_op=true) returns (PyTorch FSDP2's UnshardHandle).
  class UnshardHandle {
   public:
    /// Waits until the all-gather unshard() started has filled the unit's
    /// parameters (then they may be read outside forward). The unit's next
    /// forward waits for it as well, so a handle may go unwaited. Nothing to
    /// wait for once that forward, or a later gather, took it over, or once
    /// the unit is gone.
    void wait();

   private:
    friend class Unit;
    UnshardHandle(Unit* unit, std::weak_ptr<const void> alive, uint64_t gather)
        : unit_(unit), alive_(std::move(alive)), gather_(gather) {}
    Unit* unit_;
    std::weak_ptr<const void> alive_;  // expires with the unit's runtime
    uint64_t gather_;                  // which of the unit's gathers
  };
  /// PyTorch FSDP2's unshard: gathers this unit's parameters (not those of
  /// units nested in it) ahead of its forward, in the compute dtype, so the
  /// forward finds them gathered and its all-gather overlaps what runs
  /// before (a prefetch the user schedules, also from inside an enclosing
  /// unit's forward). The forward then frees them as it would have.
  /// Collective: every rank calls it alike. `async_op` false waits for the
  /// all-gather; true returns at once, with a handle to wait on. Nothing
  /// happens while the unit is gathered already (in its forward, or left
  /// gathered), except that values a step made stale are gathered anew, nor
  /// in its backward (which gathers itself). Call it after the optimizer
  /// step (LibTorch's SGD changes the shards without a sign of it), and on a
  /// GPU on the stream the forward runs on, as FSDP2's: waiting makes the
  /// current stream wait. Refused inside SummonFullParams.
  UnshardHandle unshard(bool async_op = false);
  /// PyTorch FSDP2's reshard: frees this unit's gathered parameters (not
  /// those of units nested in it), what unshard(), a forward under
  /// set_reshard_after_forward(false) or a backward under
  /// set_reshard_after_backward(false) left gathered. Outside the unit's
  /// forward and backward (a unit fully_shard made may be freed in its
  /// forward: the next operator on its parameters gathers them again);
  /// refused inside SummonFullParams. Nothing is freed that a graph built by
  /// a backward with create_graph holds, nor NO_SHARD's full-precision
  /// parameters, which are never sharded. It communicates
  /// nothing, but every rank calls it alike: the next gather is collective.
  void reshard();
  /// Module::save for the unit's module `self` (its wrapper, or the module
  /// fully_shard made a unit): writes what the unwrapped module
  /// would write (full parameters under their own names, buffers, children).
  /// The full parameters a unit holds (summoned, or never sharded) are
  /// written as they are; the others are gathered (collective: every rank
  /// saves), refused inside SummonFullParams. Nested units save their own.
  /// See Note [Saving a unit].
  void save_unit(const torch::nn::Module& self, torch::serialize::OutputArchive& archive) const;
  /// Module::load for the unit's module `self`: reads full parameters as the
  /// unwrapped module would and keeps this rank's part in the shard. Every
  /// rank loads the whole file; no communication.
  void load_unit(torch::nn::Module& self, torch::serialize::InputArchive& archive);

 protected:
  explicit Unit(FSDPOptions options);

  /// Flattens the parameters of `self` (the wrapper module, whose parameters
  /// and children are the wrapped module's, `wrapped`) that no nested unit
  /// owns, initialising meta ones first (see Note [Deferred initialisation]).
  void init_unit(torch::nn::Module& self, torch::nn::Module* wrapped = nullptr);
  /// Makes `module` itself the unit (fsdp::fully_shard): its parameters
  /// that no nested unit owns are flattened, and operators on them drive the
  /// unit (see Note [Units driven by dispatch]). Instead of init_unit().
  void init_in_place(torch::nn::Module& module);
  /// Makes this a pass-through (see is_active()) around `wrapped`; instead of
  /// init_unit().
  void deactivate(torch::nn::Module* wrapped = nullptr);
  /// Module::to for the wrapper `self` (device and dtype each optional):
  /// moves what no unit owns (buffers) as LibTorch does, and leaves the
  /// units' parameters, which must already be on that device in that dtype;
  /// otherwise an error naming the unit, before anything changed. See Note
  /// [Module::to on a sharded model].
  void to_unit(torch::nn::Module& self, c10::optional<c10::Device> device,
               c10::optional<at::ScalarType> dtype, bool non_blocking);
  /// Module::clone (and a Cloneable parent's copy) of the wrapper `self`:
  /// refused with one line naming the ways that work, on the rank that
  /// clones. See Note [Cloning a wrapped model].
  [[noreturn]] void refuse_clone(const torch::nn::Module& self) const;
  /// Called by the wrapper before the wrapped forward.
  void pre_forward();
  /// Raises the error for a checkpointed forward whose output type (the
  /// mangled name) activation_checkpoint() cannot take apart.
  [[noreturn]] void refuse_activation_checkpointing(const char* output_type) const;
  /// Called by the wrapper after pre_forward() with the tensors of the
  /// forward's arguments; `all_found` false when an argument's type may hide
  /// some. See Note [Parameters backward reads without a gradient].
  void record_forward_inputs(const std::vector<at::Tensor>& inputs, bool all_found);
  /// Called by the wrapper after the wrapped forward with the tensors of its
  /// output. `unknown_output_type` (a mangled type name) when the output's
  /// type hides its tensors: then a unit that trains is refused.
  void post_forward(const std::vector<at::Tensor>& outputs,
                    const char* unknown_output_type = nullptr);

 private:
  friend class detail::UnitRuntime;
  friend class detail::RootState;
  // Units (active, with a runtime) of this unit's module tree, pre-order.
  std::vector<Unit*> units_in_tree() const;
  // units_in_tree() with `recurse`, else this unit (checked active): what a
  // setting with a `recurse` argument covers.
  std::vector<Unit*> units_to_set(bool recurse);
  // The parameters of this unit's module tree that no unit manages (those
  // of ignored modules), each once, with their paths.
  std::vector<std::pair<std::string, at::Tensor>> unmanaged_parameters() const;
  // The runtime, checked to exist (an active unit).
  detail::UnitRuntime& runtime() const;

  // nullptr for a pass-through wrapper (see is_active()).
  std::unique_ptr<detail::UnitRuntime> runtime_;
  torch::nn::Module* wrapped_ = nullptr;  // constant after init_unit / deactivate
};

/// The name of a training state, for messages.
const char* to_string(Unit::TrainingState state);

/// The unit `module` is: an active FSDP wrapper, or a module fully_shard made
/// a unit in place. nullptr otherwise (and for a pass-through wrapper).
Unit* unit_of(torch::nn::Module& module);
/// unit_of for a const module.
const Unit* unit_of(const torch::nn::Module& module);

}  // namespace fsdp
