#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <fsdp/comm/process_group.h>
#include <fsdp/core/mixed_precision.h>

namespace fsdp {

/// How a unit's parameters are sharded between uses (PyTorch's names).
enum class ShardingStrategy : uint8_t {
  /// Parameters, gradients and optimizer state sharded; parameters are
  /// gathered before forward, freed after it, gathered again for backward.
  kFullShard,
  /// Like kFullShard, but parameters stay gathered from forward through backward.
  kShardGradOp,
  /// Nothing sharded; gradients are all-reduced (data parallelism, DDP).
  kNoShard,
  /// kFullShard within each node, replicated across nodes: parameters are
  /// gathered inside the node only; gradients are reduce-scattered inside
  /// the node, then each shard is all-reduced with its replicas on the other
  /// nodes. Cross-node traffic: one all-reduce of a shard per unit and step.
  /// See FSDPOptions::hybrid_groups.
  kHybridShard,
  /// kShardGradOp within each node, replicated across nodes (PyTorch's
  /// _HYBRID_SHARD_ZERO2): parameters stay gathered from forward through
  /// backward.
  kHybridShardZero2,
};

/// Which all-gather is issued early during backward (PyTorch's names). With
/// either prefetch, a FULL_SHARD or HYBRID_SHARD unit whose forward ends last
/// also keeps its parameters gathered into its backward, which comes first:
/// one all-gather fewer per step than FSDP1 (kNone keeps FSDP1's schedule).
enum class BackwardPrefetch : uint8_t {
  /// Gather each unit only when its own backward starts.
  kNone,
  /// When a unit's backward starts, also start gathering the unit whose
  /// backward comes next (more overlap, one more unit's memory).
  kBackwardPre,
  /// Start gathering the next unit once this unit's gradients are reduced.
  kBackwardPost,
};

/// The name of a strategy, for messages.
const char* to_string(ShardingStrategy strategy);

/// Where a unit's sharded state lives between uses (PyTorch FSDP1's
/// CPUOffload, FSDP2's CPUOffloadPolicy): `fsdp::CPUOffload().offload_params(true)`.
struct CPUOffload {
  /// The unit's flat shard, its gradient, and so the optimizer's state for
  /// it, live in host memory, while the unit gathers and computes on its
  /// device: each unshard copies the shard to the device first, each reduced
  /// gradient is copied back, and the optimizer steps on the CPU (as
  /// PyTorch's, the unit's optimizer must be made for CPU tensors). On a
  /// unit whose device is the CPU the same copies run between host buffers:
  /// the results are those without offload.
  TORCH_ARG(bool, offload_params) = false;
  /// Page-locked host memory for the shards where the unit's device is a GPU
  /// (PyTorch FSDP2's pin_memory): faster, asynchronous copies; memory that
  /// cannot be pinned is an error naming the bytes asked for.
  TORCH_ARG(bool, pin_memory) = true;
};

/// Options of an FSDP unit, in LibTorch's style:
/// `fsdp::FSDPOptions().sharding_strategy(fsdp::ShardingStrategy::kShardGradOp)`.
struct FSDPOptions {
  /// The group to shard over; nullptr: fsdp::default_process_group(). For
  /// the hybrid strategies, the whole job, which hybrid_groups splits.
  TORCH_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
  /// kHybridShard and kHybridShardZero2: the shard and replicate groups.
  /// nullopt: made once per job from the launch topology, by
  /// new_hybrid_groups(process_group, ranks per node) with the ranks per node
  /// of fsdp::rank_info() (LOCAL_WORLD_SIZE, or what mpirun / srun say).
  /// Given (e.g. groups made by new_hybrid_groups with another size, or by
  /// hand with new_subgroup), they are used as they are and process_group
  /// must be unset or their world. Ignored by the other strategies.
  TORCH_ARG(c10::optional<HybridGroups>, hybrid_groups) = c10::nullopt;
  /// See ShardingStrategy.
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kFullShard;
  /// The device the unit's flat parameter, shards and gradients live on
  /// (PyTorch's device_id). nullopt: the device of the unit's parameters, the
  /// CPU for parameters on the meta device (materialised there). Set to a
  /// GPU, the unit's parameters and buffers built on the CPU move there, as
  /// PyTorch's do; parameters on another GPU are an error naming them. The
  /// CPU and the CUDA devices this process sees are accepted; any other
  /// device is refused with an error on every rank.
  TORCH_ARG(c10::optional<c10::Device>, device_id) = c10::nullopt;
  /// Issue the next unit's all-gather (in the first iteration's forward
  /// order) before this unit computes, so communication overlaps compute.
  TORCH_ARG(bool, forward_prefetch) = false;
  /// See BackwardPrefetch; it matters for kFullShard only.
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::kBackwardPre;
  /// The optimizer steps one view of the shard per original parameter
  /// (possibly empty on ranks that hold none of it) instead of one flat
  /// shard, so parameter groups (e.g. no weight decay on biases) work.
  ///
  /// Parameters that receive no gradient (unused in the forward on every
  /// rank): with use_orig_params their views keep an undefined .grad, so
  /// optimizers skip them as in plain LibTorch (one small all-reduce per
  /// backward agrees on which got one). With flat shards (false) the unit's
  /// gradient is one tensor: they get zeros, so weight decay and momentum
  /// still move them; a warning names them once per unit. A unit none of
  /// whose parameters got a gradient on any rank keeps its shard's .grad as
  /// it was. A unit's parameters must all require gradients or none, unless
  /// use_orig_params (then a warning).
  TORCH_ARG(bool, use_orig_params) = false;
  /// Check the forward order of units (the root's option counts): in the
  /// first training iteration ranks agree on each unit before gathering it
  /// (an error on every rank when they differ); later iterations warn once
  /// when a rank's order changes. See Note [Forward order].
  TORCH_ARG(bool, check_forward_order) = true;
  /// See CPUOffload; by default the shards live on the unit's device.
  TORCH_ARG(CPUOffload, cpu_offload) = {};
  /// See MixedPrecision; nullopt: every unit computes in the model's dtype.
  TORCH_ARG(c10::optional<MixedPrecision>, mixed_precision) = c10::nullopt;
  /// Deferred initialisation (see Note [Deferred initialisation] in
  /// fsdp/core/reset_parameters.h): when a unit is made, it is called once on
  /// each module the unit manages that has parameters or buffers of its own
  /// on the meta device, after libfsdp gave them real (uninitialised) CPU
  /// storage and before sharding; it must fill them in place. nullopt: such
  /// modules are reset with fsdp::reset_parameters(). An empty function is
  /// rejected ("expected param_init_fn to be callable").
  TORCH_ARG(c10::optional<std::function<void(torch::nn::Module&)>>, param_init_fn) = c10::nullopt;
  /// Broadcast rank 0's parameters and buffers when each unit is made, so
  /// every rank starts from rank 0's model.
  TORCH_ARG(bool, sync_module_states) = false;
  /// Modules (and their subtrees) whose parameters and buffers no unit
  /// manages: they keep their own full tensors on every rank, are neither
  /// sharded nor reduced (their gradients stay local), and come last in a
  /// unit's parameters(), as in PyTorch's FSDP.
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, ignored_modules) = {};
  /// Parameters no unit manages, wherever they are registered (PyTorch
  /// FSDP2's ignored_params: a few parameters inside a module that is
  /// sharded otherwise): as ignored_modules' parameters, they keep their
  /// full tensors on every rank, are neither sharded nor reduced (their
  /// gradients stay local), and come last in a unit's parameters(). Every
  /// unit made with these options leaves them out.
  TORCH_ARG(std::vector<at::Tensor>, ignored_params) = {};
  /// Run the unit's wrapped forward under fsdp::activation_checkpoint(): its
  /// activations are recomputed in backward from the parameters that FSDP
  /// gathers for backward anyway. See Unit::set_activation_checkpointing.
  TORCH_ARG(bool, activation_checkpointing) = false;

 public:  // TORCH_ARG leaves the members private
  /// FSDP2's reshard_after_forward: sets sharding_strategy to kFullShard
  /// (true) or kShardGradOp (false), or within the hybrid strategies to
  /// kHybridShard or kHybridShardZero2; refused for kNoShard.
  FSDPOptions& reshard_after_forward(bool on);
  /// Whether the strategy frees a unit's gathered parameters after forward.
  bool reshard_after_forward() const;
};

}  // namespace fsdp
