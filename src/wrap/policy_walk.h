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

/// A unit a policy walk plans: its module, its path from the root, and its
/// options (a CustomPolicy's may differ from the call's).
struct PlannedUnit {
  const torch::nn::Module* module;
  std::string path;
  const FSDPOptions* options;
};

/// The checks the planned units, then the root, would make of their
/// parameters, made before any unit is so that a refusal changes nothing:
/// no parameter that a planned unit would manage is also held by a module
/// outside that unit (tied weights between two units, or between a unit and
/// the root: a tied embedding whose head is a unit), and each unit's managed
/// parameters are all trainable or all frozen (PyTorch's
/// _validate_frozen_params; a warning under use_orig_params comes from each
/// unit as it is made). `planned`: in post-order (a unit manages what the
/// units before it do not); `managed`: parameters managed already (ignored
/// ones, units made before); `ignored`: FSDPOptions::ignored_modules';
/// `call`: the options the caller was given, the root's. Before those, each
/// planned unit's options (a CustomPolicy's) get the checks the unit would
/// make when made: a callable param_init_fn, and the call's own
/// ignored_modules and ignored_params (every unit and the root leave out
/// the same ones). `api` names the caller in the errors, as the walk's
/// errors do.
void check_planned_units(const torch::nn::Module& root, const std::vector<PlannedUnit>& planned,
                         ParamSet managed, const ParamSet& ignored, const FSDPOptions& call,
                         int rank, const char* api);

/// The warning of a policy walk that made units of `found` ("Class at path")
/// with mixed precision off; `api` names the caller, as the walk's errors do.
void warn_full_precision_units(int rank, const char* api, const std::vector<std::string>& found);

}  // namespace fsdp::detail
