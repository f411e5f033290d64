#pragma once

#include <c10/util/Type.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include <fsdp/wrap/options.h>
#include <fsdp/wrap/sequential.h>

namespace fsdp {

/// Decides, for each module of a tree, whether auto_wrap makes it an FSDP
/// unit: PyTorch's auto_wrap_policy. A cheap-to-copy value (it holds
/// std::functions), so the policies below convert to it and combine with `|`.
///
/// A policy sees the module, its path under the Sequential given to auto_wrap
/// ("3.0", as in named_parameters()) and its *unwrapped numel*: the number of
/// elements of the parameters in its subtree that no unit made before it owns.
/// auto_wrap asks in post-order, so every descendant has been decided first.
class AutoWrapPolicy {
 public:
  /// What a policy asks of one module.
  using Fn = std::function<bool(const torch::nn::Module& module, const std::string& path,
                                int64_t unwrapped_numel)>;

  /// A policy that selects no module.
  AutoWrapPolicy();
  /// A policy that makes a unit of each module for which `should_wrap` is
  /// true. `should_recurse` (PyTorch's `recurse=True` call; nullptr: always)
  /// is asked before a module's descendants, with the unwrapped numel of its
  /// whole subtree; when false, neither the module nor anything under it is
  /// wrapped. `description` names the policy in messages.
  AutoWrapPolicy(Fn should_wrap, std::string description, Fn should_recurse = nullptr);

  /// What a CustomPolicy asks: whether to make `module` a unit, changing
  /// `options` (a copy of the call's) for that unit alone.
  using OptionsFn = std::function<bool(const torch::nn::Module& module, const std::string& path,
                                       int64_t unwrapped_numel, FSDPOptions& options)>;

  /// True when `module` should become a unit.
  bool should_wrap(const torch::nn::Module& module, const std::string& path,
                   int64_t unwrapped_numel) const;
  /// should_wrap(), and when true, `options` changed as the policy asks for
  /// this unit (unchanged but by a CustomPolicy).
  bool should_wrap(const torch::nn::Module& module, const std::string& path,
                   int64_t unwrapped_numel, FSDPOptions& options) const;
  /// True when auto_wrap should look at `module`'s subtree at all.
  bool should_recurse(const torch::nn::Module& module, const std::string& path,
                      int64_t unwrapped_numel) const;
  /// The policy, for messages: "MinParamsPolicy(100000)".
  const std::string& description() const { return description_; }

 protected:
  /// A policy that may change each unit's options (CustomPolicy, UnionPolicy).
  AutoWrapPolicy(OptionsFn should_wrap, std::string description, Fn should_recurse);

 private:
  Fn should_wrap_;
  OptionsFn should_wrap_with_options_;  // set instead of should_wrap_
  Fn should_recurse_;
  std::string description_;
};

/// Selects every module (PyTorch's always_wrap_policy). Modules reached only
/// through a typed member cannot be wrapped in place, so with this policy
/// auto_wrap accepts only trees made of Sequential entries.
class AlwaysWrapPolicy : public AutoWrapPolicy {
 public:
  AlwaysWrapPolicy();
};

/// Selects a module when its unwrapped numel is at least `min_num_params`
/// (PyTorch's size_based_auto_wrap_policy, same default). As there, it never
/// selects a ModuleList or ModuleDict (they have no forward), and never looks
/// inside a MultiheadAttention (its projections are typed members).
class MinParamsPolicy : public AutoWrapPolicy {
 public:
  /// With PyTorch's default force_leaf_modules and exclude_wrap_modules.
  explicit MinParamsPolicy(int64_t min_num_params = 100000000);
  /// With PyTorch's force_leaf_modules (never looked into, so neither they
  /// nor anything under them is selected: their parameters join the
  /// enclosing unit; they replace default_force_leaf_modules()) and
  /// exclude_wrap_modules (never selected, though looked into; they replace
  /// default_exclude_wrap_modules()), classes made with
  /// fsdp::module_class<Impl>().
  MinParamsPolicy(int64_t min_num_params, std::vector<ModuleClass> force_leaf_modules,
                  std::vector<ModuleClass> exclude_wrap_modules);
  /// {MultiheadAttention}: PyTorch's FORCE_LEAF_MODULES.
  static std::vector<ModuleClass> default_force_leaf_modules();
  /// {ModuleList, ModuleDict}: PyTorch's EXCLUDE_WRAP_MODULES.
  static std::vector<ModuleClass> default_exclude_wrap_modules();
};

/// Selects the modules for which `fn(module, path, unwrapped_numel)` is true
/// (PyTorch's lambda_auto_wrap_policy, with more to look at).
class LambdaPolicy : public AutoWrapPolicy {
 public:
  explicit LambdaPolicy(Fn fn, std::string description = "LambdaPolicy");
};

/// Selects the modules for which `fn(module, path, unwrapped_numel, options)`
/// is true, each made a unit with `options` as `fn` leaves them (PyTorch's
/// CustomPolicy, whose lambda returns True or the unit's keyword arguments):
/// `options` is a copy of the options auto_wrap or fully_shard was given, so
/// `fn` changes only what differs for that unit.
/// ```
/// fsdp::CustomPolicy([](const torch::nn::Module& m, const std::string& path, int64_t,
///                       fsdp::FSDPOptions& o) {
///   if (m.as<BlockImpl>() == nullptr) return false;
///   if (path == "blocks.11") o.sharding_strategy(fsdp::ShardingStrategy::kShardGradOp);
///   return true;
/// });
/// ```
/// The checks made before any unit (frozen and trainable parameters mixed,
/// ignored modules, module_classes_to_ignore) read the call's options.
class CustomPolicy : public AutoWrapPolicy {
 public:
  explicit CustomPolicy(OptionsFn fn, std::string description = "CustomPolicy");
};

/// Selects the modules that are of one of the given types or derive from one
/// (PyTorch's ModuleWrapPolicy, isinstance semantics; tested with
/// dynamic_cast). Made with fsdp::module_type_policy<Impl...>().
class ModuleTypePolicy : public AutoWrapPolicy {
 public:
  /// One type to match: its name for messages and a test of a module.
  struct Type {
    std::string name;
    std::function<bool(const torch::nn::Module&)> matches;
  };
  explicit ModuleTypePolicy(std::vector<Type> types);
};

/// The ModuleTypePolicy of the module types Impls (the Impl classes, as
/// torch::nn::LinearImpl, not the holders):
/// `fsdp::module_type_policy<torch::nn::LinearImpl, MyBlockImpl>()`.
template <typename... Impls>
ModuleTypePolicy module_type_policy() {
  static_assert(sizeof...(Impls) > 0, "fsdp::module_type_policy needs at least one module type");
  static_assert((std::is_base_of_v<torch::nn::Module, Impls> && ...),
                "fsdp::module_type_policy takes module Impl types (torch::nn::LinearImpl), "
                "not holders (torch::nn::Linear)");
  return ModuleTypePolicy(
      {ModuleTypePolicy::Type{c10::demangle(typeid(Impls).name()), [](const torch::nn::Module& m) {
                                return dynamic_cast<const Impls*>(&m) != nullptr;
                              }}...});
}

/// Selects a module when any of `policies` does, and looks inside it when any
/// of them would (PyTorch's _or_policy). A unit's options are those of the
/// first policy that selects it (a CustomPolicy's changes).
class UnionPolicy : public AutoWrapPolicy {
 public:
  explicit UnionPolicy(std::vector<AutoWrapPolicy> policies);

 private:
  struct Parts;  // built before the members move in
  static Parts parts_of(std::vector<AutoWrapPolicy> policies);
  explicit UnionPolicy(Parts parts);
};

/// `a | b`: the UnionPolicy of a and b.
UnionPolicy operator|(const AutoWrapPolicy& a, const AutoWrapPolicy& b);

/// One unit made by auto_wrap.
struct AutoWrappedUnit {
  /// Path of the wrapped module under the Sequential given to auto_wrap ("3.0").
  std::string path;
  /// The unit, now in the module's Sequential slot.
  AnyUnit unit;
};

/// Makes FSDP units, in place, of the modules under `seq` that `policy`
/// selects (PyTorch's auto wrapping), and returns them in the order made.
///
/// C++ modules have no forward hooks, so a module can only be rewrapped where
/// it is called through a type-erased slot: an entry of a Sequential (see
/// wrap_sequential_entry). auto_wrap walks the whole tree under `seq` in
/// post-order (children in registration order, then the parent), looking
/// inside entries that are themselves Sequentials (classes deriving from
/// torch::nn::SequentialImpl with a concrete forward), so inner entries
/// become units before the entries holding them, whose units then manage
/// only what is left. `seq` itself is not a candidate: wrap it afterwards as
/// the root, e.g. with fsdp::FullyShardedDataParallel<torch::nn::SequentialImpl>.
///
/// Every decision is made before any unit is: it fails, changing nothing,
/// when the tree already holds an FSDP unit (naming the first found), when
/// the policy selects a module that is no Sequential entry (a typed member),
/// or one reached at more than one place.
///
/// Rules from PyTorch's _wrap_utils (seed 003):
/// - frozen and trainable parameters: the parameters each unit would manage
///   (the planned units in post-order, then what is left for the root) must
///   be all trainable or all frozen. With use_orig_params(false) a mix is an
///   error, with use_orig_params(true) a warning giving the numel the
///   gradients will take instead of the trainable numel; both list the
///   parameter names on each side.
/// - options.ignored_modules(): never wrapped nor looked into; their
///   parameters are counted by no policy and managed by no unit.
/// - options.mixed_precision(): modules of its module_classes_to_ignore
///   (the BatchNorm family by default) become units of their own with mixed
///   precision off (see Unit::keep_full_precision), with a warning naming them.
/// - an empty param_init_fn is rejected before anything is wrapped.
/// Every rank must call it alike (units are made collectively).
std::vector<AutoWrappedUnit> auto_wrap(torch::nn::Sequential& seq, const AutoWrapPolicy& policy,
                                       FSDPOptions options = {});

/// The paths auto_wrap(seq, policy, options) would wrap, in the order it
/// would, with the same checks (ignored_modules, the classes mixed
/// precision keeps in full precision, use_orig_params' leniency); makes
/// nothing, so it needs no process group.
std::vector<std::string> auto_wrap_paths(const torch::nn::Sequential& seq,
                                         const AutoWrapPolicy& policy, FSDPOptions options = {});

}  // namespace fsdp
