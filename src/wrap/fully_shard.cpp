// fsdp::fully_shard: units made in place (see Note [Units made in place] and
// Note [Units driven by dispatch]).

#include <fsdp/wrap/fully_shard.h>

#include <memory>
#include <string>
#include <unordered_set>

#include "core/flat_parameter.h"
#include "detail/error.h"
#include "runtime/in_place_units.h"
#include "runtime/unit_init.h"

namespace fsdp {
namespace {

// The policy form's walk: post-order, registration order, each module once.
class InPlacePlanner {
 public:
  InPlacePlanner(const AutoWrapPolicy& policy, const FSDPOptions& options)
      : policy_(policy), options_(options), ignored_(detail::ignored_module_set(options)) {}

  void walk(torch::nn::Module& m, const std::string& path) {
    if (ignored_.count(&m) != 0 || !visited_.insert(&m).second) return;
    if (const Unit* unit = unit_of(m)) {  // sharded by the caller before
      own(*unit);
      return;
    }
    if (policy_.should_recurse(m, path, unowned_numel(m))) {
      for (const auto& child : m.named_children()) {
        walk(*child.value(), path.empty() ? child.key() : path + "." + child.key());
      }
    }
    if (policy_.should_wrap(m, path, unowned_numel(m)) || kept_in_full_precision(m)) {
      detail::UnitPathScope scope(path);
      own(fully_shard(m, options_));
    }
  }

 private:
  void own(const Unit& unit) {
    if (unit.flat_param() == nullptr) return;
    for (const auto& slot : unit.flat_param()->slots()) {
      owned_.insert(slot.param.unsafeGetTensorImpl());
    }
  }

  int64_t unowned_numel(const torch::nn::Module& m) const {
    int64_t n = 0;
    for (const auto& p : m.parameters(/*recurse=*/true)) {
      if (owned_.count(p.unsafeGetTensorImpl()) == 0) n += p.numel();
    }
    return n;
  }

  // MixedPrecision::module_classes_to_ignore: units of their own, kept in
  // full precision (as auto_wrap makes them).
  bool kept_in_full_precision(const torch::nn::Module& m) const {
    const auto& mp = options_.mixed_precision();
    if (!mp || !mp->param_dtype()) return false;
    for (const auto& c : mp->module_classes_to_ignore()) {
      if (c.matches(m)) return true;
    }
    return false;
  }

  const AutoWrapPolicy& policy_;
  const FSDPOptions& options_;
  detail::ModuleSet ignored_;
  std::unordered_set<const torch::nn::Module*> visited_;
  std::unordered_set<const void*> owned_;  // parameters of the units made so far
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
