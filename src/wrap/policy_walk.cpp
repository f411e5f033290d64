#include "wrap/policy_walk.h"

#include <c10/util/Exception.h>
#include <fsdp/wrap/wrapper_traits.h>

#include <string>
#include <unordered_map>
#include <unordered_set>

#include "detail/error.h"
#include "runtime/unit_init.h"

namespace fsdp::detail {

int64_t unowned_numel(const torch::nn::Module& m, const ParamSet& owned) {
  ParamSet seen;  // tied parameters count once
  int64_t numel = 0;
  for (const auto& p : m.parameters()) {
    const void* key = p.unsafeGetTensorImpl();
    if (owned.count(key) == 0 && seen.insert(key).second) numel += p.numel();
  }
  return numel;
}

void own_params(const torch::nn::Module& m, ParamSet& owned) {
  for (const auto& p : m.parameters()) owned.insert(p.unsafeGetTensorImpl());
}

std::vector<ModuleClass> full_precision_classes(const FSDPOptions& options) {
  if (!options.mixed_precision()) return {};
  return options.mixed_precision()->module_classes_to_ignore();
}

const torch::nn::Module& wrapped_module(const torch::nn::Module& m) {
  const torch::nn::Module* inner = &m;
  while (const auto* w = dynamic_cast<const ModuleWrapper*>(inner)) inner = &w->original_module();
  return *inner;
}

const ModuleClass* class_of(const torch::nn::Module& m, const std::vector<ModuleClass>& classes) {
  const torch::nn::Module& inner = wrapped_module(m);
  for (const auto& c : classes) {
    if (c.matches(m) || c.matches(inner)) return &c;
  }
  return nullptr;
}

bool holds_class(const torch::nn::Module& m, const std::vector<ModuleClass>& classes) {
  if (classes.empty()) return false;
  if (class_of(m, classes) != nullptr) return true;
  for (const auto& sub : m.modules(/*include_self=*/false)) {
    if (class_of(*sub, classes) != nullptr) return true;
  }
  return false;
}

namespace {

// See check_planned_units: tied weights between units.
void check_no_parameter_in_two_units(const torch::nn::Module& root,
                                     const std::vector<PlannedUnit>& planned,
                                     const ParamSet& ignored, int rank, const char* api) {
  std::unordered_map<const void*, const torch::nn::Module*> unit_of_param;  // the innermost
  for (const PlannedUnit& u : planned) {
    for (const auto& p : u.module->parameters()) {
      unit_of_param.emplace(p.unsafeGetTensorImpl(), u.module);
    }
  }
  std::unordered_map<const torch::nn::Module*, std::string> path_of;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    path_of.emplace(item.value().get(), item.key());
  }
  std::unordered_map<const torch::nn::Module*, std::unordered_set<const torch::nn::Module*>> under;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      const void* impl = p.value().unsafeGetTensorImpl();
      const auto it = unit_of_param.find(impl);
      if (ignored.count(impl) != 0 || it == unit_of_param.end()) continue;
      auto [subtree, fresh] = under.try_emplace(it->second);
      if (fresh) {
        for (const auto& m : it->second->modules(/*include_self=*/true))
          subtree->second.insert(m.get());
      }
      if (subtree->second.count(item.value().get()) != 0) continue;
      const std::string name = item.key().empty() ? p.key() : item.key() + "." + p.key();
      const std::string unit = path_of.at(it->second);
      FSDP_FAIL(rank, api, "parameter '", name,
                "' is the same tensor as a parameter of the unit the policy selects at '", unit,
                "' (tied weights), and ", item.key().empty() ? "the root" : "'" + item.key() + "'",
                " is outside that unit. A parameter shared between units must belong to one "
                "unit: keep the modules that share it in one unit (leave '",
                unit,
                "' out of the policy, so that its parameters join the enclosing unit). Nothing "
                "was wrapped");
    }
  }
}

// See check_planned_units: one unit's managed parameters, those not in
// `seen`, all trainable or all frozen.
void check_uniform(const torch::nn::Module& m, const std::string& path, ParamSet& seen,
                   bool use_orig_params, int rank) {
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& p : m.named_parameters()) {
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) {
      params.emplace_back(path.empty() ? p.key() : path + "." + p.key(), p.value());
    }
  }
  check_uniform_requires_grad(params, path, use_orig_params, rank, /*warn=*/false);
}

// See check_planned_units: the options a CustomPolicy gave the unit at `path`.
void check_unit_options(const FSDPOptions& unit, const FSDPOptions& call, const std::string& path,
                        int rank, const char* api) {
  const auto same_modules = unit.ignored_modules() == call.ignored_modules();
  bool same_params = unit.ignored_params().size() == call.ignored_params().size();
  for (size_t i = 0; same_params && i < unit.ignored_params().size(); ++i) {
    same_params = unit.ignored_params()[i].unsafeGetTensorImpl() ==
                  call.ignored_params()[i].unsafeGetTensorImpl();
  }
  FSDP_CHECK(same_modules && same_params, rank, path, api, "'s policy changed ",
             same_modules ? "ignored_params" : "ignored_modules", " for the unit at ", path,
             ". They are the call's: every unit and the root leave out the same modules and "
             "parameters. Set them on the options given to ",
             api, ", not in a CustomPolicy");
  check_param_init_fn(unit, path);
}

}  // namespace

void check_planned_units(const torch::nn::Module& root, const std::vector<PlannedUnit>& planned,
                         ParamSet managed, const ParamSet& ignored, const FSDPOptions& call,
                         int rank, const char* api) {
  for (const PlannedUnit& u : planned) check_unit_options(*u.options, call, u.path, rank, api);
  check_no_parameter_in_two_units(root, planned, ignored, rank, api);
  for (const PlannedUnit& u : planned)
    check_uniform(*u.module, u.path, managed, u.options->use_orig_params(), rank);
  check_uniform(root, "", managed, call.use_orig_params(), rank);
}

void warn_full_precision_units(int rank, const char* api, const std::vector<std::string>& found) {
  if (found.empty()) return;
  std::string names;
  for (const std::string& f : found) names += (names.empty() ? "" : ", ") + f;
  TORCH_WARN(error_prefix(rank, api),
             "both mixed precision and an auto-wrap policy were given, and the model has "
             "modules of classes that must compute in full precision: [",
             names,
             "]. These modules are wrapped as separate FSDP units with mixed precision disabled "
             "(their inputs are cast to their parameters' dtype and their outputs back). "
             "Change MixedPrecision::module_classes_to_ignore to choose these classes.");
}

}  // namespace fsdp::detail
