#include <fsdp/runtime/reduced_grad_hooks.h>

#include <memory>

#include "detail/error.h"
#include "runtime/unit_runtime.h"

// See Note [Steps during backward] in root_state.cpp.

namespace fsdp {

void set_reduced_grad_hooks(torch::nn::Module& model, const ReducedGradHooks& hooks) {
  const auto shared = hooks.on_reduced ? std::make_shared<const ReducedGradHooks>(hooks) : nullptr;
  const std::vector<detail::UnitRuntime*> units = detail::UnitRuntime::all_in(model);
  for (const detail::UnitRuntime* unit : units) {
    FSDP_CHECK(unit->state() == Unit::TrainingState::kIdle, -1, "set_reduced_grad_hooks",
               unit->label(), " is in ", to_string(unit->state()),
               ": install reduced-gradient hooks between steps, not inside forward or backward");
  }
  FSDP_CHECK(!units.empty(), -1, "set_reduced_grad_hooks", hooks.owner,
             ": the model has no FSDP unit; pass the wrapped model (the FSDP root)");
  for (detail::UnitRuntime* unit : units) unit->set_grad_hooks(shared);
}

}  // namespace fsdp
