#include <fsdp/wrap/activation_checkpointing.h>

#include <fsdp/runtime/unit.h>
#include <fsdp/wrap/auto_wrap.h>

#include <string>
#include <utility>
#include <vector>

#include "detail/error.h"
#include "wrap/policy_walk.h"
#include "wrap/sequential_entry.h"

namespace fsdp {

namespace detail {
void check_not_a_unit_to_checkpoint(const torch::nn::Module& m) {
  // A unit made in place is the module itself, and has no forward of its own
  // to checkpoint (set_activation_checkpointing would do nothing there).
  const auto* wrapper = dynamic_cast<const Unit*>(&m);
  FSDP_CHECK((wrapper != nullptr && wrapper->is_active()) || unit_of(m) == nullptr, -1,
             "CheckpointWrapper", "cannot wrap a ", m.name(),
             " that fsdp::fully_shard made a unit: the wrapper takes over the module's children "
             "and parameters, which would hide the unit, and a unit made in place cannot "
             "checkpoint its own forward. Checkpoint modules inside it, or wrap a module that "
             "holds it");
  FSDP_CHECK(unit_of(m) == nullptr, -1, "CheckpointWrapper",
             "cannot wrap an FSDP unit itself: the wrapper takes over the wrapped module's "
             "children and parameters, which would hide the unit. Checkpoint the unit's forward "
             "with unit->set_activation_checkpointing(true) (or FSDPOptions().activation_"
             "checkpointing(true), or apply_activation_checkpointing), or wrap a module that "
             "holds the unit");
}
}  // namespace detail

AnyCheckpointWrapperImpl::AnyCheckpointWrapperImpl(torch::nn::AnyModule module)
    : Module("CheckpointWrapper"), module_(std::move(module)) {
  FSDP_CHECK(!module_.is_empty(), -1, "apply_activation_checkpointing",
             "cannot checkpoint an empty AnyModule. Pass one that holds a module");
  detail::check_not_a_unit_to_checkpoint(*module_.ptr());
  detail::adopt_module_contents(*this, *module_.ptr());
}

at::Tensor AnyCheckpointWrapperImpl::forward(at::Tensor input) {
  torch::nn::AnyModule& m = module_;
  return detail::call_checkpointed<at::Tensor>([&m](at::Tensor& x) { return m.forward(x); },
                                               detail::module_parameters(*m.ptr()),
                                               std::move(input));
}

void AnyCheckpointWrapperImpl::train(bool on) {
  torch::nn::Module::train(on);
  module_.ptr()->train(on);
}

namespace {

/// What apply_activation_checkpointing() will do, planned before anything
/// changes so that a refused module leaves the model as it was.
struct CheckpointPlan {
  /// A Sequential entry to replace; when the Sequential is wrapped by a unit,
  /// the unit's adopted child of the same name is replaced too.
  struct Entry {
    torch::nn::Sequential seq;
    size_t index = 0;
    std::shared_ptr<torch::nn::Module> wrapper;  // or nullptr
    std::string name;                            // the child's name in `wrapper`
  };
  std::vector<Unit*> units;
  std::vector<Entry> entries;
  std::vector<std::string> refused;
  std::vector<std::string> in_place;  // units fully_shard made: refused
};

std::string quoted_path(const std::string& path) {
  return path.empty() ? std::string("the root") : "'" + path + "'";
}

std::string comma_joined(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& i : items) out += (out.empty() ? "" : ", ") + i;
  return out;
}

/// The Sequential whose entry `m`, a child of `parent`, is: `parent` itself,
/// or the Sequential an FSDP unit `parent` wraps (which adopted its entries).
std::shared_ptr<torch::nn::SequentialImpl> sequential_of(
    const std::shared_ptr<torch::nn::Module>& parent) {
  if (auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(parent)) return seq;
  const auto* unit = dynamic_cast<const Unit*>(parent.get());
  if (unit == nullptr || unit->wrapped_module() == nullptr) return nullptr;
  auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(unit->wrapped_module());
  if (seq == nullptr) return nullptr;
  return std::shared_ptr<torch::nn::SequentialImpl>(parent, seq);  // kept alive by the wrapper
}

bool is_checkpoint_wrapper(const torch::nn::Module& m) { return m.name() == "CheckpointWrapper"; }

// Note [Which modules apply_activation_checkpointing checkpoints]
// PyTorch's apply_activation_checkpointing is _recursive_wrap with
// only_wrap_children=True, and so is this walk: post-order (a module's
// children, in registration order, before it), the root never a candidate,
// the policy asked before a subtree (should_recurse, with the subtree's
// numel) and after it (should_wrap, with what its checkpointed descendants
// leave: a size policy checkpoints a parent only for its remainder). A match
// inside a match is checkpointed too, as there: the outer region's
// recomputation runs the inner region, which recomputes once more in the
// outer's backward. One departure: a module already checkpointed (a
// CheckpointWrapper) is neither looked into nor checkpointed again, so that
// a second call changes nothing (PyTorch's would nest a second wrapper).
class CheckpointPlanner {
 public:
  explicit CheckpointPlanner(const AutoWrapPolicy& policy) : policy_(policy) {}

  // The checkpointed numel under `m` (at `path`, the child `name` of
  // `parent`): all of it when `m` becomes a region.
  int64_t plan(const std::shared_ptr<torch::nn::Module>& parent, const std::string& name,
               const std::shared_ptr<torch::nn::Module>& m, const std::string& path) {
    if (is_checkpoint_wrapper(*m)) return detail::unowned_numel(*m, {});  // already checkpointed
    auto* unit = dynamic_cast<Unit*>(m.get());
    const bool wrapper = unit != nullptr && unit->is_active();
    // A wrapper unit is asked about as the module it wraps (a check_fn
    // naming BlockImpl matches the unit of a block).
    const torch::nn::Module& target =
        wrapper && unit->wrapped_module() != nullptr ? *unit->wrapped_module() : *m;
    const int64_t numel = detail::unowned_numel(target, {});
    if (!policy_.should_recurse(target, path, numel)) return 0;
    const int64_t below = plan_children(m, path);
    if (parent == nullptr || !policy_.should_wrap(target, path, numel - below)) return below;
    if (wrapper) {
      if (!unit->checkpoints_activations()) plan_.units.push_back(unit);  // else done before
    } else if (unit_of(*m) != nullptr) {
      // A unit made in place has no wrapper forward to checkpoint; a
      // checkpoint wrapper would hide it (check_not_a_unit_to_checkpoint).
      plan_.in_place.push_back(quoted_path(path));
    } else if (!plan_entry(parent, name, *m)) {
      plan_.refused.push_back(quoted_path(path));
    }
    return numel;
  }

  int64_t plan_children(const std::shared_ptr<torch::nn::Module>& m, const std::string& path) {
    int64_t below = 0;
    for (const auto& child : m->named_children()) {
      below += plan(m, child.key(), child.value(),
                    path.empty() ? child.key() : path + "." + child.key());
    }
    return below;
  }

  CheckpointPlan& result() { return plan_; }

 private:
  // Plans the replacement of `m`, the child `name` of `parent`, when it is a
  // Sequential entry.
  bool plan_entry(const std::shared_ptr<torch::nn::Module>& parent, const std::string& name,
                  const torch::nn::Module& m) {
    auto seq = sequential_of(parent);
    if (seq == nullptr) return false;
    for (size_t i = 0; i < seq->size(); ++i) {
      if (seq->ptr(i).get() != &m) continue;
      const bool wrapped = seq.get() != parent.get();
      plan_.entries.push_back(
          CheckpointPlan::Entry{torch::nn::Sequential(seq), i, wrapped ? parent : nullptr, name});
      return true;
    }
    return false;
  }

  const AutoWrapPolicy& policy_;
  CheckpointPlan plan_;
};

}  // namespace

int apply_activation_checkpointing(torch::nn::Module& root,
                                   const std::function<bool(const torch::nn::Module&)>& check_fn) {
  FSDP_CHECK(
      static_cast<bool>(check_fn), -1, "apply_activation_checkpointing",
      "expected check_fn to be callable. Pass a function that says which modules to "
      "checkpoint, e.g. [](const torch::nn::Module& m) { return m.as<BlockImpl>() != nullptr; }");
  // PyTorch's lambda_auto_wrap_policy: every subtree looked into.
  return apply_activation_checkpointing(
      root, AutoWrapPolicy([check_fn](const torch::nn::Module& m, const std::string&,
                                      int64_t) { return check_fn(m); },
                           "check_fn"));
}

int apply_activation_checkpointing(torch::nn::Module& root, const AutoWrapPolicy& policy) {
  CheckpointPlanner planner(policy);
  // The root is no candidate, and has no parent to be replaced in: a
  // shared_ptr that owns nothing (Note [Which modules
  // apply_activation_checkpointing checkpoints]).
  planner.plan(nullptr, "",
               std::shared_ptr<torch::nn::Module>(std::shared_ptr<torch::nn::Module>(), &root), "");
  CheckpointPlan& plan = planner.result();
  FSDP_CHECK(plan.in_place.empty(), -1, "apply_activation_checkpointing", "cannot checkpoint ",
             comma_joined(plan.in_place),
             ": fsdp::fully_shard made each a unit in place, which cannot checkpoint its own "
             "forward (and a checkpoint wrapper around it would hide the unit). Nothing was "
             "changed. Leave it out of check_fn and checkpoint modules inside it, or a Sequential "
             "entry that holds it");
  const std::string refused = comma_joined(plan.refused);
  FSDP_CHECK(refused.empty(), -1, "apply_activation_checkpointing", "cannot checkpoint ", refused,
             ": each is a member of its parent's class (not a Sequential entry nor an FSDP "
             "unit), whose type cannot change. Nothing was changed. Declare such a member as "
             "fsdp::CheckpointWrapper<Impl>, make it an fsdp::FullyShardedDataParallel<Impl> "
             "unit, or leave it out of check_fn");
  for (Unit* unit : plan.units) unit->set_activation_checkpointing(true);
  for (CheckpointPlan::Entry& e : plan.entries) {
    std::shared_ptr<torch::nn::Module> replacement;
    detail::replace_sequential_entry(e.seq, e.index, "apply_activation_checkpointing",
                                     [&replacement](torch::nn::AnyModule entry) {
                                       AnyCheckpointWrapper wrapper(std::move(entry));
                                       replacement = wrapper.ptr();
                                       return torch::nn::AnyModule(wrapper);
                                     });
    if (e.wrapper != nullptr) e.wrapper->replace_module(e.name, replacement);
  }
  return static_cast<int>(plan.units.size() + plan.entries.size());
}

}  // namespace fsdp
