#include <fsdp/wrap/summon_full_params.h>

#include <fsdp/runtime/unit.h>

namespace fsdp {

SummonFullParams::SummonFullParams(torch::nn::Module& root) {
  // Every rank walks the same tree in the same (pre-)order, so the
  // all-gathers pair up.
  for (const auto& m : root.modules(/*include_self=*/true)) {
    auto* unit = dynamic_cast<Unit*>(m.get());
    if (unit == nullptr || unit->flat_param() == nullptr) continue;
    if (unit->flat_param()->state() == FlatParameter::State::kSharded) {
      unit->flat_param()->unshard();
      gathered_.push_back(unit);
    }
  }
}

SummonFullParams::~SummonFullParams() {
  for (Unit* unit : gathered_) unit->flat_param()->reshard();
}

}  // namespace fsdp
