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
  // all-gathers pair up. Each unit checks that it is idle. A unit an
  // enclosing guard holds is left as it is, on every rank (Note [Nested
  // summons]). With rank0_only the other ranks free each unit as soon as it
  // gathered, so they never hold more than one.
  Unit* gathering = nullptr;  // the unit being gathered, until it is in units_
  try {
    for (const auto& m : root.modules(/*include_self=*/true)) {
      Unit* unit = unit_of(*m);
      if (unit == nullptr || unit->flat_param() == nullptr || unit->held_by_summon_guard()) {
        continue;
      }
      unit->before_state_use();  // Note [Steps during backward]
      // The job's rank (the unit's world group), not the shard group's:
      // under HYBRID_SHARD every node has a shard-group rank 0.
      const int rank = unit->fsdp_options().process_group()->rank();
      gathering = unit;
      const bool gathered =
          unit->gather_full_params(options.offload_to_cpu(), options.with_grads());
      unit->enter_summon_guard();
      units_.push_back(unit);
      gathering = nullptr;
      if (!gathered) continue;
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
    if (gathering != nullptr) gathered_.push_back(gathering);
    for (Unit* unit : gathered_) {
      try {
        unit->release_full_params();
      } catch (...) {  // NOLINT(bugprone-empty-catch): the first error is the one to report
      }
    }
    for (Unit* unit : units_) unit->leave_summon_guard();
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
  for (Unit* unit : units_) unit->leave_summon_guard();
  detail::end_unreported_uses();
}

}  // namespace fsdp
