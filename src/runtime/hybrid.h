#pragma once

#include <fsdp/comm/process_group.h>
#include <fsdp/runtime/options.h>

namespace fsdp::detail {

/// The groups of a unit with a hybrid strategy (Note [Hybrid sharding]):
/// options.hybrid_groups() when given (checked against process_group), else
/// the groups new_hybrid_groups makes from the launch topology, made once per
/// world group and shared by every unit that uses them. Collective the first
/// time: every rank makes its hybrid units in the same order.
HybridGroups resolve_hybrid_groups(const FSDPOptions& options);

}  // namespace fsdp::detail
