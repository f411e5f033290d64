#pragma once

// torchrun's c10d rendezvous for fsdprun: the same command on every node,
// node ranks assigned as the nodes join.

#include <functional>
#include <string>

#include "options.h"

namespace fsdp::launch {

/// What the rendezvous gives a node.
struct Assignment {
  int node_rank = -1;       ///< 0 on the node that serves it, 1.. in the order the others joined
  std::string master_addr;  ///< where the ranks meet (MASTER_ADDR; the port is the endpoint's)
};

/// Meets the other nodes at options.rdzv_host:rdzv_port (for
/// options.assigns_node_ranks(); see Note [fsdprun's rendezvous] in
/// rendezvous.cpp). False with a one-line `error` when the nodes did not all
/// meet within options.join_timeout_s, or this node was refused (another
/// FSDP_JOB_TOKEN, --rdzv-id, --nnodes or --nproc-per-node than the serving
/// node's, or one node too many). `progress` gets a line now and then while
/// nodes are missing, and one for each node refused.
bool join_rendezvous(const LaunchOptions& options, const std::string& token,
                     const std::function<void(const std::string&)>& progress,
                     Assignment* assignment, std::string* error);

}  // namespace fsdp::launch
