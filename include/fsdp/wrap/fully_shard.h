#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>

#include <fsdp/runtime/options.h>
#include <fsdp/runtime/unit.h>
#include <fsdp/wrap/auto_wrap.h>

namespace fsdp {

/// Makes `module` an FSDP unit in place (PyTorch's FSDP2 fully_shard): its
/// class, its members, its forward code and as<...>() casts are unchanged,
/// and named_parameters() keeps its names. The unit manages the parameters
/// of `module`'s tree that no unit made before owns, so shard inner modules
/// first and the model last (or use the policy form below). LibTorch modules
/// have no forward hooks: the operators on the unit's parameters drive it
/// (see Note [Units driven by dispatch]), so the model is called as before.
///
/// `module` must be owned by a shared_ptr (a ModuleHolder's, or
/// std::make_shared), and outlive the unit's use. Returns the unit: build the
/// optimizer on the root's flat_parameters(), clip with its
/// clip_grad_norm_(), and use no_sync() on it. Every rank must call it alike
/// (units are made collectively).
///
/// Outside forward and backward the parameters are sharded: reading one
/// gathers its unit (collective, on every rank). torch::save(model) writes
/// full values only under fsdp::SummonFullParams (outside, LibTorch 2.4+
/// refuses the save naming a parameter); prefer fsdp::Checkpointer or
/// fsdp::full_state_dict.
///
/// Refused, before anything changes: a tree holding an active
/// FullyShardedDataParallel wrapper (a tree is sharded one way), and
/// FSDPOptions::activation_checkpointing (only a wrapper's forward can run
/// under it: checkpoint with fsdp::CheckpointWrapper<Impl> members or
/// fsdp::apply_activation_checkpointing instead).
Unit& fully_shard(torch::nn::Module& module, FSDPOptions options = {});

/// fully_shard of the module a holder (torch::nn::Linear, a TORCH_MODULE) holds.
template <typename Impl>
Unit& fully_shard(torch::nn::ModuleHolder<Impl>& module, FSDPOptions options = {}) {
  return fully_shard(*module.ptr(), std::move(options));
}

/// Makes a unit, in place, of every module under `root` that `policy` selects
/// (anywhere: ModuleList and ModuleDict entries, typed members, holder
/// members), innermost first, then of `root` itself, which becomes the root
/// unit and manages what is left. The tree is walked as auto_wrap walks it
/// (post-order, registration order; each policy sees the numel no unit made
/// before it owns; a module the policy does not recurse into is no unit, nor
/// is anything under it), minus its Sequential-only restriction. As there,
/// modules of MixedPrecision::module_classes_to_ignore (anywhere) become
/// units of their own with mixed precision off, with a warning naming them.
/// The refusals above are checked before any unit is made. Returns the
/// root's unit.
Unit& fully_shard(torch::nn::Module& root, const AutoWrapPolicy& policy, FSDPOptions options = {});

/// The policy form of fully_shard for the module a holder holds.
template <typename Impl>
Unit& fully_shard(torch::nn::ModuleHolder<Impl>& root, const AutoWrapPolicy& policy,
                  FSDPOptions options = {}) {
  return fully_shard(*root.ptr(), policy, std::move(options));
}

}  // namespace fsdp
