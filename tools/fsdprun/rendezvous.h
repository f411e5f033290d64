#pragma once

// torchrun's c10d rendezvous for fsdprun: the same command on every node,
// node ranks assigned as the nodes join.

#include <functional>
#include <string>

#include "options.h"

namespace fsdp::launch {

/// This node's rank in the job, from the rendezvous at
/// options.rdzv_host:rdzv_port (for options.assigns_node_ranks(); see Note
/// [fsdprun's rendezvous] in rendezvous.cpp): 0 on the node that serves it,
/// 1.. in the order the others joined. -1 with a one-line `error` when the
/// nodes did not all meet within options.join_timeout_s, or this node was
/// refused (another FSDP_JOB_TOKEN, --rdzv-id, --nnodes or
/// --nproc-per-node than the serving node's). `progress` gets a line now and
/// then while nodes are missing, and one for each node refused.
int join_rendezvous(const LaunchOptions& options, const std::string& token,
                    const std::function<void(const std::string&)>& progress, std::string* error);

}  // namespace fsdp::launch
