// fsdp::fully_shard: units made in place (see Note [Units made in place] and
// Note [Units driven by dispatch]).

#include <fsdp/wrap/fully_shard.h>

#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "detail/error.h"
#include "runtime/in_place_units.h"
#include "runtime/unit_init.h"
#include "wrap/policy_walk.h"

namespace fsdp {
namespace {

// The policy form's walk: post-order, registration order, each module once,
// with auto_wrap's rules (wrap/policy_walk.h).
class InPlacePlanner {
 public:
  InPlacePlanner(const AutoWrapPolicy& policy, const FSDPOptions& options)
      : policy_(policy),
        options_(options),
        ignored_(detail::ignored_module_set(options)),
        full_precision_(detail::full_precision_classes(options)),
        owned_(detail::ignored_params(options)) {}

  void walk(torch::nn::Module& m, const std::string& path) {
    if (ignored_.count(&m) != 0 || !visited_.insert(&m).second) return;
    if (unit_of(m) != nullptr) {  // sharded by the caller before
      detail::own_params(m, owned_);
      return;
    }
    if (policy_.should_recurse(m, path, detail::unowned_numel(m, owned_)) ||
        detail::holds_class(m, full_precision_)) {
      for (const auto& child : m.named_children()) {
        walk(*child.value(), path.empty() ? child.key() : path + "." + child.key());
      }
    }
    if (policy_.should_wrap(m, path, detail::unowned_numel(m, owned_)) ||
        detail::class_of(m, full_precision_) != nullptr) {
      detail::UnitPathScope scope(path);
      fully_shard(m, options_);
      detail::own_params(m, owned_);
    }
  }

 private:
  const AutoWrapPolicy& policy_;
  const FSDPOptions& options_;
  detail::ModuleSet ignored_;
  std::vector<ModuleClass> full_precision_;  // units of their own (MixedPrecision)
  std::unordered_set<const torch::nn::Module*> visited_;
  detail::ParamSet owned_;  // parameters of the units made so far, and the ignored ones
};

}  // namespace

Unit& fully_shard(torch::nn::Module& module, FSDPOptions options) {
  FSDP_CHECK(!module.weak_from_this().expired(), -1, module.name(),
             "fully_shard needs a module owned by a shared_ptr (a ModuleHolder such as "
             "torch::nn::Linear or your TORCH_MODULE, or std::make_shared), so that its unit "
             "lives exactly as long as it; got one built without (on the stack, or as a "
             "plain member). Build it through its holder");
  Unit::check_not_a_unit(module);
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    const auto* wrapper = dynamic_cast<const Unit*>(item.value().get());
    FSDP_CHECK(wrapper == nullptr || !wrapper->is_active(), -1, module.name(),
               "fully_shard found an fsdp::FullyShardedDataParallel wrapper at '", item.key(),
               "'. A tree is sharded one way: wrappers or fully_shard, not both. Unwrap it "
               "and fully_shard that module instead");
  }
  return detail::make_in_place_unit(module, std::move(options));
}

Unit& fully_shard(torch::nn::Module& root, const AutoWrapPolicy& policy, FSDPOptions options) {
  InPlacePlanner planner(policy, options);
  for (const auto& child : root.named_children()) planner.walk(*child.value(), child.key());
  return fully_shard(root, std::move(options));
}

}  // namespace fsdp
