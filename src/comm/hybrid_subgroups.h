#pragma once

// Making HYBRID_SHARD's groups from a node layout.

#include <memory>
#include <vector>

#include <fsdp/comm/process_group.h>

namespace fsdp::detail {

/// The hybrid groups of `world` whose nodes are `nodes` (each a sorted list
/// of ranks, all of one size, every rank in one): a shard group per node
/// and a replicate group of the ranks at each position on their nodes; this
/// rank's of each. Every rank of `world` calls it with the same nodes in the
/// same order, as new_subgroup requires.
HybridGroups hybrid_groups_of_nodes(const std::shared_ptr<ProcessGroup>& world,
                                    const std::vector<std::vector<int>>& nodes);

}  // namespace fsdp::detail
