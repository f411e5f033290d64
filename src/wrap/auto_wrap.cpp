#include <fsdp/wrap/auto_wrap.h>

#include <c10/util/Exception.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <fsdp/comm/init.h>
#include <fsdp/runtime/unit.h>

#include "detail/error.h"
#include "runtime/unit_init.h"
#include "wrap/policy_walk.h"

namespace fsdp {

using torch::nn::Module;
using torch::nn::SequentialImpl;

AutoWrapPolicy::AutoWrapPolicy()
    : AutoWrapPolicy([](const Module&, const std::string&, int64_t) { return false; },
                     "NoWrapPolicy") {}

AutoWrapPolicy::AutoWrapPolicy(Fn should_wrap, std::string description, Fn should_recurse)
    : should_wrap_(std::move(should_wrap)),
      should_recurse_(std::move(should_recurse)),
      description_(std::move(description)) {}

AutoWrapPolicy::AutoWrapPolicy(OptionsFn should_wrap, std::string description, Fn should_recurse)
    : should_wrap_with_options_(std::move(should_wrap)),
      should_recurse_(std::move(should_recurse)),
      description_(std::move(description)) {}

bool AutoWrapPolicy::should_wrap(const Module& module, const std::string& path,
                                 int64_t unwrapped_numel) const {
  FSDPOptions unused;
  return should_wrap(module, path, unwrapped_numel, unused);
}

bool AutoWrapPolicy::should_wrap(const Module& module, const std::string& path,
                                 int64_t unwrapped_numel, FSDPOptions& options) const {
  // Asked about the wrapper, then about the module it wraps (a block in a
  // CheckpointWrapper is the block's type to a policy; PyTorch asks both).
  const Module& inner = detail::wrapped_module(module);
  if (should_wrap_) {
    return should_wrap_(module, path, unwrapped_numel) ||
           (&inner != &module && should_wrap_(inner, path, unwrapped_numel));
  }
  if (!should_wrap_with_options_) return false;
  // A policy that says no leaves the options as they were.
  for (const Module* m : {&module, &inner}) {
    FSDPOptions changed = options;
    if (should_wrap_with_options_(*m, path, unwrapped_numel, changed)) {
      options = std::move(changed);
      return true;
    }
    if (&inner == &module) break;
  }
  return false;
}

bool AutoWrapPolicy::should_recurse(const Module& module, const std::string& path,
                                    int64_t unwrapped_numel) const {
  if (!should_recurse_) return true;
  const Module& inner = detail::wrapped_module(module);
  return should_recurse_(module, path, unwrapped_numel) ||
         (&inner != &module && should_recurse_(inner, path, unwrapped_numel));
}

AlwaysWrapPolicy::AlwaysWrapPolicy()
    : AutoWrapPolicy([](const Module&, const std::string&, int64_t) { return true; },
                     "AlwaysWrapPolicy") {}

std::vector<ModuleClass> MinParamsPolicy::default_force_leaf_modules() {
  return {module_class<torch::nn::MultiheadAttentionImpl>()};
}

std::vector<ModuleClass> MinParamsPolicy::default_exclude_wrap_modules() {
  return {module_class<torch::nn::ModuleListImpl>(), module_class<torch::nn::ModuleDictImpl>()};
}

namespace {
std::string class_names(const std::vector<ModuleClass>& classes) {
  std::string out = "{";
  for (const ModuleClass& c : classes) out += (out.size() > 1 ? ", " : "") + c.name;
  return out + "}";
}

std::string min_params_description(int64_t min_num_params,
                                   const std::vector<ModuleClass>& force_leaf_modules,
                                   const std::vector<ModuleClass>& exclude_wrap_modules) {
  std::string out = "MinParamsPolicy(" + std::to_string(min_num_params);
  if (class_names(force_leaf_modules) !=
      class_names(MinParamsPolicy::default_force_leaf_modules())) {
    out += ", force_leaf_modules=" + class_names(force_leaf_modules);
  }
  if (class_names(exclude_wrap_modules) !=
      class_names(MinParamsPolicy::default_exclude_wrap_modules())) {
    out += ", exclude_wrap_modules=" + class_names(exclude_wrap_modules);
  }
  return out + ")";
}

std::vector<ModuleClass> checked_classes(std::vector<ModuleClass> classes, const char* what) {
  for (const ModuleClass& c : classes) {
    FSDP_CHECK(static_cast<bool>(c.matches), -1, "MinParamsPolicy", "the class '", c.name, "' of ",
               what, " has an empty matches function. Make it with fsdp::module_class<Impl>()");
  }
  return classes;
}
}  // namespace

MinParamsPolicy::MinParamsPolicy(int64_t min_num_params)
    : MinParamsPolicy(min_num_params, default_force_leaf_modules(),
                      default_exclude_wrap_modules()) {}

MinParamsPolicy::MinParamsPolicy(int64_t min_num_params,
                                 std::vector<ModuleClass> force_leaf_modules,
                                 std::vector<ModuleClass> exclude_wrap_modules)
    : AutoWrapPolicy(
          // Containers without a forward are never called, so a unit there
          // would never gather (the default exclude_wrap_modules).
          [min_num_params, exclude = checked_classes(exclude_wrap_modules, "exclude_wrap_modules")](
              const Module& m, const std::string&, int64_t numel) {
            return numel >= min_num_params && detail::class_of(m, exclude) == nullptr;
          },
          min_params_description(min_num_params, force_leaf_modules, exclude_wrap_modules),
          // A subtree smaller than the minimum holds nothing to select;
          // MultiheadAttention uses its projections' weights directly (the
          // default force_leaf_modules), inside a wrapper too (class_of looks
          // through wrappers).
          [min_num_params, leaves = checked_classes(force_leaf_modules, "force_leaf_modules")](
              const Module& m, const std::string&, int64_t numel) {
            return numel >= min_num_params && detail::class_of(m, leaves) == nullptr;
          }) {
  FSDP_CHECK(min_num_params >= 0, -1, "MinParamsPolicy", "expected min_num_params >= 0, got ",
             min_num_params, ". A parameter count cannot be negative. Pass 0 to select every ",
             "module.");
}

namespace {
// Empty, a LambdaPolicy would select nothing, silently.
AutoWrapPolicy::Fn callable_fn(AutoWrapPolicy::Fn fn) {
  FSDP_CHECK(static_cast<bool>(fn), -1, "LambdaPolicy",
             "expected a callable fn, got an empty std::function. Pass a function of (module, "
             "path, unwrapped_numel) that returns whether to make the module a unit");
  return fn;
}
}  // namespace

LambdaPolicy::LambdaPolicy(Fn fn, std::string description)
    : AutoWrapPolicy(callable_fn(std::move(fn)), std::move(description)) {}

namespace {
AutoWrapPolicy::OptionsFn callable_options_fn(AutoWrapPolicy::OptionsFn fn) {
  FSDP_CHECK(static_cast<bool>(fn), -1, "CustomPolicy",
             "expected a callable fn, got an empty std::function. Pass a function of (module, "
             "path, unwrapped_numel, options) that returns whether to make the module a unit "
             "and may change options for it");
  return fn;
}
}  // namespace

CustomPolicy::CustomPolicy(OptionsFn fn, std::string description)
    : AutoWrapPolicy(callable_options_fn(std::move(fn)), std::move(description), nullptr) {}

namespace {

std::string describe_types(const std::vector<ModuleTypePolicy::Type>& types) {
  std::string out = "ModuleTypePolicy(";
  for (size_t i = 0; i < types.size(); ++i) out += (i ? ", " : "") + types[i].name;
  return out + ")";
}

std::string describe_union(const std::vector<AutoWrapPolicy>& policies) {
  std::string out = "(";
  for (size_t i = 0; i < policies.size(); ++i) out += (i ? " | " : "") + policies[i].description();
  return out + ")";
}

// Built here so that the description is taken before the list moves into
// the predicate (the parameters are sinks: no copy of the list is made).
AutoWrapPolicy type_policy(std::vector<ModuleTypePolicy::Type> types) {
  for (const auto& t : types) {
    FSDP_CHECK(static_cast<bool>(t.matches), -1, "ModuleTypePolicy", "the type '", t.name,
               "' has an empty matches function. Give it a test of a module, or make the policy "
               "with fsdp::module_type_policy<Impl...>()");
  }
  std::string description = describe_types(types);
  return AutoWrapPolicy(
      [types = std::move(types)](const Module& m, const std::string&, int64_t) {
        for (const auto& t : types) {
          if (t.matches(m)) return true;
        }
        return false;
      },
      std::move(description));
}

}  // namespace

ModuleTypePolicy::ModuleTypePolicy(std::vector<Type> types)
    : AutoWrapPolicy(type_policy(std::move(types))) {}

struct UnionPolicy::Parts {
  OptionsFn should_wrap;
  std::string description;
  Fn should_recurse;
};

UnionPolicy::Parts UnionPolicy::parts_of(std::vector<AutoWrapPolicy> policies) {
  std::string description = describe_union(policies);
  // Both predicates read one list.
  auto members = std::make_shared<const std::vector<AutoWrapPolicy>>(std::move(policies));
  Parts parts;
  parts.should_wrap = [members](const Module& m, const std::string& path, int64_t numel,
                                FSDPOptions& options) {
    for (const auto& p : *members) {
      if (p.should_wrap(m, path, numel, options)) return true;
    }
    return false;
  };
  parts.description = std::move(description);
  // A member that would descend must see the subtree, even if the others
  // would prune it (PyTorch's _or_policy asks with recurse=True).
  parts.should_recurse = [members](const Module& m, const std::string& path, int64_t numel) {
    for (const auto& p : *members) {
      if (p.should_recurse(m, path, numel)) return true;
    }
    return false;
  };
  return parts;
}

UnionPolicy::UnionPolicy(std::vector<AutoWrapPolicy> policies)
    : UnionPolicy(parts_of(std::move(policies))) {}

UnionPolicy::UnionPolicy(Parts parts)
    : AutoWrapPolicy(std::move(parts.should_wrap), std::move(parts.description),
                     std::move(parts.should_recurse)) {}

UnionPolicy operator|(const AutoWrapPolicy& a, const AutoWrapPolicy& b) {
  return UnionPolicy({a, b});
}

namespace {

// The rank shown in messages: the group the units would use, when known.
int message_rank(const std::shared_ptr<ProcessGroup>& group) {
  if (group) return group->rank();
  if (is_initialized()) return default_process_group()->rank();
  return 0;
}

std::string shown(const std::string& path) { return path.empty() ? "<root>" : path; }

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// Where a module is called from. Only a Sequential slot can be patched; for
// anything else `reason` says why not.
struct Slot {
  std::shared_ptr<SequentialImpl> parent;
  size_t index = 0;
  std::string reason;
};

// A unit to make: entry `index` of `parent`, at `path`. `full_precision`:
// a module of MixedPrecision::module_classes_to_ignore, wrapped with mixed
// precision off.
struct Planned {
  std::string path;
  std::shared_ptr<SequentialImpl> parent;
  size_t index;
  const Module* module = nullptr;
  bool full_precision = false;
  FSDPOptions options;  // the call's, as a CustomPolicy changed them for this unit
};

// Decides every unit before any is made, so a refusal changes nothing.
class Planner {
 public:
  Planner(const AutoWrapPolicy& policy, const FSDPOptions& options, int rank)
      : policy_(policy), options_(options), rank_(rank) {
    ignored_ = detail::ignored_module_set(options);
    owned_ = detail::ignored_params(options);
    ignored_params_ = owned_;
    mp_classes_ = detail::full_precision_classes(options);
  }

  std::vector<Planned> plan(const std::shared_ptr<SequentialImpl>& root) {
    survey(root, "");
    visit(root, "", Slot{});
    std::vector<detail::PlannedUnit> units;
    for (const Planned& p : planned_) units.push_back({p.module, p.path, &p.options});
    detail::check_planned_units(*root, units, ignored_params_, ignored_params_, options_, rank_,
                                "auto_wrap");
    warn_full_precision();
    return std::move(planned_);
  }

 private:
  // Pre-order, registration order, like named_modules(): rejects existing
  // units (the first found is named) and records every path of every module.
  // A pass-through wrapper (fsdp::wrap() outside an EnableWrap scope) is the
  // module it holds, as PyTorch's wrap() returns the module itself.
  void survey(const std::shared_ptr<Module>& m, const std::string& path) {
    const auto* wrapper = dynamic_cast<const Unit*>(m.get());
    FSDP_CHECK((wrapper == nullptr || !wrapper->is_active()) && unit_of(*m) == nullptr, rank_,
               shown(path), "expected a module tree without FSDP units, got ", m->name(), " at ",
               shown(path),
               ". auto_wrap decides every unit itself and does not nest new units around units "
               "made before (as PyTorch's auto wrapping). Call auto_wrap once, on the unwrapped "
               "model, or wrap the whole model by hand.");
    auto& paths = paths_[m.get()];
    paths.push_back(path);
    if (paths.size() > 1) return;  // its subtree was surveyed at its first path
    for (const auto& c : m->named_children()) survey(c.value(), join(path, c.key()));
  }

  // Post-order: the children in registration order, then the module.
  void visit(const std::shared_ptr<Module>& m, const std::string& path, const Slot& slot) {
    if (!visited_.insert(m.get()).second) return;  // decided at its first path
    if (ignored_.count(m.get()) != 0) return;      // FSDPOptions::ignored_modules
    const bool recurse = policy_.should_recurse(*m, path, unwrapped_numel(*m)) ||
                         detail::holds_class(*m, mp_classes_);
    if (!recurse) return;
    const auto seq = std::dynamic_pointer_cast<SequentialImpl>(m);
    const auto children = m->named_children();
    for (size_t i = 0; i < children.size(); ++i) {
      visit(children[i].value(), join(path, children[i].key()), slot_of(m, seq, children, i, path));
    }
    if (path.empty()) return;  // the root: the caller wraps it
    const int64_t numel = unwrapped_numel(*m);
    const ModuleClass* fp_class = detail::class_of(*m, mp_classes_);
    FSDPOptions unit_options = options_;
    const bool selected = policy_.should_wrap(*m, path, numel, unit_options);
    if (!selected && fp_class == nullptr) return;
    FSDP_CHECK(
        slot.parent != nullptr, rank_, path, "expected the modules that ", policy_.description(),
        fp_class != nullptr ? " (or mixed precision's module_classes_to_ignore)" : "",
        " selects to be Sequential entries, got ", m->name(), ", ", slot.reason,
        ". C++ modules have no forward hooks, so auto_wrap can only rewrap a module "
        "called through a Sequential's type-erased slot. Make it an entry of a "
        "torch::nn::Sequential, or keep it out of the policy (its parameters then join "
        "the enclosing unit) and, to make it a unit of its own, wrap that part of the "
        "model by hand with fsdp::FullyShardedDataParallel<Impl> where its parent calls "
        "it.",
        !selected ? " Mixed precision, not the policy, selects this one: hold it as "
                    "fsdp::FullyShardedDataParallel<Impl>, use fsdp::fully_shard's policy form "
                    "(which needs no Sequential slot), or remove its class from "
                    "module_classes_to_ignore."
                  : "");
    const auto& paths = paths_.at(m.get());
    FSDP_CHECK(paths.size() == 1, rank_, path, "expected the modules ", "that ",
               policy_.description(), " selects to be reached at one place, got ", m->name(),
               " also at ", shown(paths[1]),
               ". A unit in one slot would leave the other place calling the module with its "
               "parameters sharded. Give each place its own module, or keep it out of the "
               "policy.");
    detail::own_params(*m, owned_);
    planned_.push_back(Planned{path, slot.parent, slot.index, m.get(), fp_class != nullptr,
                               std::move(unit_options)});
    if (fp_class != nullptr) full_precision_found_.push_back(fp_class->name + " at " + path);
  }

  void warn_full_precision() const {
    detail::warn_full_precision_units(rank_, "auto_wrap", full_precision_found_);
  }

  // Where the parent `m` calls child i.
  static Slot slot_of(const std::shared_ptr<Module>& m, const std::shared_ptr<SequentialImpl>& seq,
                      const torch::OrderedDict<std::string, std::shared_ptr<Module>>& children,
                      size_t i, const std::string& path) {
    const Module* child = children[i].value().get();
    const std::string parent = m->name() + " (at " + shown(path) + ")";
    if (!seq) return Slot{nullptr, 0, "a typed member of " + parent};
    for (size_t e = 0; e < seq->size(); ++e) {
      // Entry e, whatever its place among the children (a Sequential
      // subclass may register others first): replace_sequential_entry finds
      // its registered child by identity.
      if (seq->ptr(e).get() == child) return Slot{seq, e, ""};
    }
    return Slot{nullptr, 0, "a module " + parent + " registers besides its entries"};
  }

  int64_t unwrapped_numel(const Module& m) const { return detail::unowned_numel(m, owned_); }

  const AutoWrapPolicy& policy_;
  const FSDPOptions& options_;
  const int rank_;
  detail::ModuleSet ignored_;  // FSDPOptions::ignored_modules and their submodules
  detail::ParamSet ignored_params_;
  std::vector<ModuleClass> mp_classes_;
  std::vector<std::string> full_precision_found_;
  std::unordered_map<const Module*, std::vector<std::string>> paths_;
  std::unordered_set<const Module*> visited_;
  detail::ParamSet owned_;  // parameters of planned units, and the ignored ones
  std::vector<Planned> planned_;
};

std::vector<Planned> plan(const torch::nn::Sequential& seq, const AutoWrapPolicy& policy,
                          const FSDPOptions& options, int rank) {
  FSDP_CHECK(!seq.is_empty(), rank, "",
             "expected a Sequential to auto-wrap, got an empty holder "
             "(torch::nn::Sequential(nullptr)). Nothing was constructed. Pass a constructed "
             "Sequential.");
  const auto& init_fn = options.param_init_fn();
  FSDP_CHECK(!init_fn.has_value() || static_cast<bool>(*init_fn), rank, "",
             "expected param_init_fn to be callable, got an empty "
             "std::function. Pass a function that initialises a module's parameters and buffers "
             "in place, or leave param_init_fn unset (nullopt) to use fsdp::reset_parameters().");
  return Planner(policy, options, rank).plan(seq.ptr());
}

}  // namespace

std::vector<AutoWrappedUnit> auto_wrap(torch::nn::Sequential& seq, const AutoWrapPolicy& policy,
                                       FSDPOptions options) {
  const auto planned = plan(seq, policy, options, message_rank(options.process_group()));
  std::vector<AutoWrappedUnit> units;
  units.reserve(planned.size());
  for (const auto& p : planned) {
    detail::UnitPathScope named(p.path);  // messages name the unit by its path
    torch::nn::Sequential parent(p.parent);
    if (!p.full_precision) {
      units.push_back(AutoWrappedUnit{p.path, wrap_sequential_entry(parent, p.index, p.options)});
      continue;
    }
    // Mixed precision off for this unit; see Planner::warn_full_precision.
    FSDPOptions full = p.options;
    full.mixed_precision(c10::nullopt);
    AnyUnit unit = wrap_sequential_entry(parent, p.index, full);
    unit->keep_full_precision();
    units.push_back(AutoWrappedUnit{p.path, unit});
  }
  return units;
}

std::vector<std::string> auto_wrap_paths(const torch::nn::Sequential& seq,
                                         const AutoWrapPolicy& policy, FSDPOptions options) {
  std::vector<std::string> paths;
  for (auto& p : plan(seq, policy, options, message_rank(options.process_group()))) {
    paths.push_back(std::move(p.path));
  }
  return paths;
}

}  // namespace fsdp
