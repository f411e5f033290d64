// fsdp::fully_shard: units made in place (see Note [Units made in place] and
// Note [Units driven by dispatch]).

#include <fsdp/wrap/fully_shard.h>

#include <c10/util/Exception.h>

#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "detail/error.h"
#include "runtime/in_place_units.h"
#include "runtime/unit_init.h"
#include "wrap/policy_walk.h"

namespace fsdp {
namespace {

// What fully_shard refuses of the module it makes a unit.
void check_module(const torch::nn::Module& module) {
  FSDP_CHECK(!module.weak_from_this().expired(), -1, module.name(),
             "fully_shard needs a module owned by a shared_ptr (a ModuleHolder such as "
             "torch::nn::Linear or your TORCH_MODULE, or std::make_shared), so that its unit "
             "lives exactly as long as it; got one built without (on the stack, or as a "
             "plain member). Build it through its holder");
  Unit::check_not_a_unit(module);
}

// What fully_shard refuses of the options (a CustomPolicy's for one unit
// too), checked before any unit is made so that a refused call leaves the
// model as it was.
void check_options(const torch::nn::Module& module, const FSDPOptions& options) {
  // Only a wrapper's forward reads the option; a unit made in place would
  // keep every activation without a word.
  FSDP_CHECK(!options.activation_checkpointing(), -1, module.name(),
             "expected FSDPOptions::activation_checkpointing off for fully_shard, got on. A unit "
             "made in place has no forward of its own to run under fsdp::activation_checkpoint(); "
             "only FullyShardedDataParallel wrappers read this option. Turn it off and "
             "checkpoint modules inside or around the units instead: declare a member "
             "fsdp::CheckpointWrapper<Impl>, or replace Sequential entries with "
             "fsdp::apply_activation_checkpointing");
  const auto& mp = options.mixed_precision();
  FSDP_CHECK(!mp || !mp->output_dtype(), -1, module.name(),
             "expected MixedPrecision::output_dtype unset for fully_shard, got ",
             c10::toString(mp && mp->output_dtype() ? *mp->output_dtype() : at::kFloat),
             ". A unit made in place sees its operators, not its module's output; cast the "
             "output yourself (logits.to(torch::kFloat)), or hold the root as a "
             "FullyShardedDataParallel wrapper");
}

// What fully_shard refuses of the tree and the options.
void check_call(const torch::nn::Module& module, const FSDPOptions& options) {
  check_module(module);
  check_options(module, options);
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    const auto* wrapper = dynamic_cast<const Unit*>(item.value().get());
    FSDP_CHECK(wrapper == nullptr || !wrapper->is_active(), -1, module.name(),
               "fully_shard found an fsdp::FullyShardedDataParallel wrapper at '", item.key(),
               "'. A tree is sharded one way: wrappers or fully_shard, not both. Unwrap it "
               "and fully_shard that module instead");
  }
}

// The policy form's walk: post-order, registration order, each module once,
// with auto_wrap's rules (Planner::visit in auto_wrap.cpp, wrap/policy_walk.h).
// Like auto_wrap it decides every unit and checks them (tied weights,
// trainable and frozen parameters mixed) before it makes any, so that a
// refusal leaves the model as it was.
class InPlacePlanner {
 public:
  InPlacePlanner(const AutoWrapPolicy& policy, const FSDPOptions& options)
      : policy_(policy),
        options_(options),
        ignored_(detail::ignored_module_set(options)),
        full_precision_(detail::full_precision_classes(options)),
        owned_(detail::ignored_params(options)),
        ignored_params_(owned_) {}

  // The root's subtree: the root is no candidate (the caller makes it the
  // root unit), but the policy is asked whether to look into it, as
  // auto_wrap and PyTorch's _recursive_wrap ask (a MultiheadAttention root
  // under MinParamsPolicy keeps its projections).
  void walk_root(torch::nn::Module& root) {
    if (!looks_into(root, "")) return;
    for (const auto& child : root.named_children()) walk(*child.value(), child.key());
  }

  void walk(torch::nn::Module& m, const std::string& path) {
    if (ignored_.count(&m) != 0 || !visited_.insert(&m).second) return;
    if (unit_of(m) != nullptr) {  // sharded by the caller before
      detail::own_params(m, owned_);
      return;
    }
    // A module the policy does not look into is no unit either, nor is
    // anything under it.
    if (!looks_into(m, path)) return;
    for (const auto& child : m.named_children()) {
      walk(*child.value(), path.empty() ? child.key() : path + "." + child.key());
    }
    const ModuleClass* fp_class = detail::class_of(m, full_precision_);
    FSDPOptions unit_options = options_;
    if (!policy_.should_wrap(m, path, detail::unowned_numel(m, owned_), unit_options) &&
        fp_class == nullptr) {
      return;
    }
    check_module(m);
    check_options(m, unit_options);
    planned_.push_back(Planned{&m, path, fp_class, std::move(unit_options)});
    detail::own_params(m, owned_);
  }

  // Whether the walk looks under `m`: the policy would, or `m` holds a
  // class to keep in full precision.
  bool looks_into(const torch::nn::Module& m, const std::string& path) const {
    return policy_.should_recurse(m, path, detail::unowned_numel(m, owned_)) ||
           detail::holds_class(m, full_precision_);
  }

  // The checks a unit makes of its parameters when it is made, for all of
  // them at once (each unit, then the root, manages what the units before
  // it do not).
  void check(const torch::nn::Module& root) const {
    // Units the caller made before manage theirs, wherever they are (under a
    // module the policy does not look into too).
    detail::ParamSet managed = ignored_params_;
    for (const auto& m : root.modules(/*include_self=*/false)) {
      if (unit_of(*m) != nullptr) detail::own_params(*m, managed);
    }
    std::vector<detail::PlannedUnit> units;
    for (const Planned& p : planned_) units.push_back({p.module, p.path, &p.options});
    detail::check_planned_units(root, units, std::move(managed), ignored_params_, options_, -1,
                                "fully_shard");
  }

  void make_units() {
    for (const Planned& p : planned_) {
      detail::UnitPathScope scope(p.path);
      if (p.fp_class == nullptr) {
        detail::make_in_place_unit(*p.module, p.options);
        continue;
      }
      // Mixed precision off, as auto_wrap makes these units: its reduce_dtype
      // and buffer_dtype too, which the unit's own check leaves on when no
      // param_dtype is given.
      FSDPOptions full = p.options;
      full.mixed_precision(c10::nullopt);
      detail::make_in_place_unit(*p.module, std::move(full)).keep_full_precision();
      full_precision_found_.push_back(p.fp_class->name + " at " + p.path);
    }
  }

  // auto_wrap's warning.
  void warn_full_precision() const {
    detail::warn_full_precision_units(-1, "fully_shard", full_precision_found_);
  }

 private:
  struct Planned {
    torch::nn::Module* module;
    std::string path;
    const ModuleClass* fp_class;  // kept in full precision (MixedPrecision)
    FSDPOptions options;          // the call's, as a CustomPolicy changed them for this unit
  };

  const AutoWrapPolicy& policy_;
  const FSDPOptions& options_;
  detail::ModuleSet ignored_;
  std::vector<ModuleClass> full_precision_;  // units of their own (MixedPrecision)
  std::vector<std::string> full_precision_found_;
  std::unordered_set<const torch::nn::Module*> visited_;
  detail::ParamSet owned_;  // parameters of the units planned so far, and the ignored ones
  detail::ParamSet ignored_params_;
  std::vector<Planned> planned_;
};

}  // namespace

Unit& fully_shard(torch::nn::Module& module, FSDPOptions options) {
  check_call(module, options);
  return detail::make_in_place_unit(module, std::move(options));
}

Unit& fully_shard(torch::nn::Module& root, const AutoWrapPolicy& policy, FSDPOptions options) {
  check_call(root, options);
  InPlacePlanner planner(policy, options);
  planner.walk_root(root);
  planner.check(root);
  planner.make_units();
  planner.warn_full_precision();
  return detail::make_in_place_unit(root, std::move(options));
}

}  // namespace fsdp
