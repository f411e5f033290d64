#include <fsdp/runtime/compute_copies.h>

#include "detail/error.h"
#include "runtime/unit_runtime.h"

// See Note [A host copy in the compute dtype] in core/flat_parameter.cpp.

namespace fsdp {

std::vector<std::pair<at::Tensor, at::Tensor>> offloaded_compute_copies(torch::nn::Module& model) {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  for (const detail::UnitRuntime* unit : detail::UnitRuntime::all_in(model)) {
    FlatParameter* flat = unit->flat();
    if (flat == nullptr || !flat->offloaded() || !flat->low_precision()) continue;
    FSDP_CHECK(unit->state() == Unit::TrainingState::kIdle, -1, "offloaded_compute_copies",
               unit->label(), " is in ", to_string(unit->state()),
               ": ask for the copies between steps, not inside forward or backward");
    const at::Tensor& copy = flat->low_precision_host_copy();
    for (const detail::GradTarget& t : unit->grad_targets(nullptr)) {
      copies.emplace_back(t.param, t.numel < 0 ? copy : copy.narrow(0, t.offset, t.numel));
    }
  }
  return copies;
}

}  // namespace fsdp
