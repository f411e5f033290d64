#pragma once

// The rules auto_wrap and fully_shard's policy form share when they walk a
// tree and ask an AutoWrapPolicy about each module.

#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include <fsdp/core/mixed_precision.h>
#include <fsdp/runtime/options.h>

namespace fsdp::detail {

/// The module `m` stands for: `m`, or the module a wrapper around it (a
/// CheckpointWrapper, a unit's wrapper) wraps, through every layer. Policies
/// and module classes are asked about it as well as about `m`, so a block
/// wrapped for activation checkpointing before the walk is still the block's
/// type (as in PyTorch, where the wrapped module stays a child of its
/// wrapper), and a policy that names the wrapper's type still matches.
const torch::nn::Module& wrapped_module(const torch::nn::Module& m);

/// Parameters, by TensorImpl.
using ParamSet = std::unordered_set<const void*>;

/// The parameters of options.ignored_modules(): no unit manages them and no
/// policy counts them.
ParamSet ignored_params(const FSDPOptions& options);

/// The elements of the parameters under `m` that are not in `owned`, tied
/// ones once: the unwrapped numel a policy is asked with.
int64_t unowned_numel(const torch::nn::Module& m, const ParamSet& owned);

/// Adds the parameters under `m` to `owned`.
void own_params(const torch::nn::Module& m, ParamSet& owned);

/// MixedPrecision::module_classes_to_ignore when mixed precision is on, else
/// none: modules of these classes become units of their own, kept in full
/// precision.
std::vector<ModuleClass> full_precision_classes(const FSDPOptions& options);

/// The first of `classes` that `m` is, or nullptr.
const ModuleClass* class_of(const torch::nn::Module& m, const std::vector<ModuleClass>& classes);

/// Whether `m` or a module under it is of one of `classes` (the walk must look
/// inside it, whatever the policy says).
bool holds_class(const torch::nn::Module& m, const std::vector<ModuleClass>& classes);

/// Refuses, before any unit is made, a parameter that a planned unit would
/// manage and a module outside that unit's subtree also holds: tied weights
/// between two units, or between a unit and the root (a tied embedding
/// whose head is a unit). `planned`: the units' modules in post-order (the
/// innermost unit of a parameter first); ignored parameters are left out.
/// `api` names the caller in the error, as the walk's errors do.
void check_no_parameter_in_two_units(const torch::nn::Module& root,
                                     const std::vector<const torch::nn::Module*>& planned,
                                     const ParamSet& ignored, int rank, const char* api);

/// The warning of a policy walk that made units of `found` ("Class at path")
/// with mixed precision off; `api` names the caller, as the walk's errors do.
void warn_full_precision_units(int rank, const char* api, const std::vector<std::string>& found);

}  // namespace fsdp::detail
