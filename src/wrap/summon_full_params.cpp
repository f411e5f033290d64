#include <fsdp/wrap/summon_full_params.h>

#include <c10/util/Exception.h>

#include <fsdp/runtime/unit.h>

namespace fsdp {

SummonFullParams::SummonFullParams(torch::nn::Module& root, SummonOptions options)
    : options_(options) {
  TORCH_CHECK(!(options.writeback() && options.rank0_only()),
              "fsdp SummonFullParams: writeback and rank0_only cannot be combined: the other "
              "ranks would write back parameters they never received. Use one of them.");
  // Every rank walks the same tree in the same (pre-)order, so the
  // all-gathers pair up.
  for (const auto& m : root.modules(/*include_self=*/true)) {
    auto* unit = dynamic_cast<Unit*>(m.get());
    if (unit == nullptr || unit->flat_param() == nullptr) continue;
    units_.push_back(unit);
    FlatParameter& flat = *unit->flat_param();
    if (flat.state() == FlatParameter::State::kSharded) {
      flat.unshard();
      gathered_.push_back(unit);
    }
  }
  const int rank = units_.empty() ? 0 : units_.front()->flat_param()->group().rank();
  if (options_.rank0_only() && rank != 0) {
    for (Unit* unit : gathered_) unit->flat_param()->reshard();
    gathered_.clear();
  }
}

SummonFullParams::~SummonFullParams() {
  if (options_.writeback()) {
    for (Unit* unit : units_) unit->flat_param()->copy_unsharded_into_shard();
  }
  for (Unit* unit : gathered_) unit->flat_param()->reshard();
}

}  // namespace fsdp
