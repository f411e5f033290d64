#include "wrap/policy_walk.h"

#include <c10/util/Exception.h>
#include <fsdp/wrap/wrapper_traits.h>

#include <string>

#include "detail/error.h"

namespace fsdp::detail {

ParamSet ignored_params(const FSDPOptions& options) {
  ParamSet out;
  for (const auto& m : options.ignored_modules()) {
    if (m != nullptr) own_params(*m, out);
  }
  return out;
}

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
    if (c.matches(inner)) return &c;
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
