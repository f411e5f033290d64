#include <fsdp/wrap/summon_full_params.h>

#include <c10/util/Exception.h>

#include <fsdp/runtime/unit.h>

#include "core/flat_parameter.h"
#include "core/sharded_placeholder.h"
#include "detail/error.h"

namespace fsdp {

SummonFullParams::SummonFullParams(torch::nn::Module& root, SummonOptions options)
    : options_(options) {
  FSDP_CHECK(!(options.writeback() && options.rank0_only()), -1, "SummonFullParams",
             "writeback and rank0_only cannot be combined: the other ranks would write back "
             "parameters they never received. Use one of them");
  // Every rank walks the same tree in the same (pre-)order, so the
  // all-gathers pair up. Each unit checks that it is idle.
  // With rank0_only the other ranks free each unit as soon as it gathered,
  // so they never hold more than one.
  try {
    for (const auto& m : root.modules(/*include_self=*/true)) {
      Unit* unit = unit_of(*m);
      if (unit == nullptr || unit->flat_param() == nullptr) continue;
      unit->before_state_use();  // Note [Steps during backward]
      units_.push_back(unit);
      // The job's rank (the unit's world group), not the shard group's:
      // under HYBRID_SHARD every node has a shard-group rank 0.
      const int rank = unit->fsdp_options().process_group()->rank();
      if (!unit->gather_full_params(options.offload_to_cpu(), options.with_grads())) continue;
      if (options_.rank0_only() && rank != 0) {
        unit->release_full_params();
      } else {
        gathered_.push_back(unit);
      }
    }
  } catch (...) {
    // A constructor that throws runs no destructor: give back what was
    // gathered (a unit left summoned could not train), the unit that failed
    // part-way included, then report the first error.
    if (!units_.empty()) gathered_.push_back(units_.back());
    for (Unit* unit : gathered_) {
      try {
        unit->release_full_params();
      } catch (...) {  // NOLINT(bugprone-empty-catch): the first error is the one to report
      }
    }
    throw;
  }
  // The user's reads and writes of the full parameters are no forward (Note
  // [Units driven by dispatch]); ended in the destructor. Last: a constructor
  // that throws runs no destructor.
  detail::begin_unreported_uses();
}

SummonFullParams::~SummonFullParams() {
  if (options_.writeback()) {
    for (Unit* unit : units_) unit->write_back_full_params();
  }
  for (Unit* unit : gathered_) unit->release_full_params();
  detail::end_unreported_uses();
}

}  // namespace fsdp
