#pragma once

// torchrun's c10d rendezvous for fsdprun: the same command on every node,
// node ranks assigned as the nodes join.

#include <sys/socket.h>

#include <functional>
#include <string>
#include <vector>

#include "options.h"

namespace fsdp::launch {

/// What the rendezvous gives a node.
struct Assignment {
  int node_rank = -1;       ///< 0 on the node that serves it, 1.. in the order the others joined
  std::string master_addr;  ///< where the ranks meet (MASTER_ADDR; the port is the endpoint's)
  int nnodes = 0;           ///< the job's nodes (MIN to MAX for --nnodes MIN:MAX)
};

/// What the rendezvous tells its caller, and asks it.
struct Hooks {
  /// Gets a line now and then while nodes are missing, and one for each
  /// node refused.
  std::function<void(const std::string&)> progress;
  /// Asked a few times a second: true ends the rendezvous (a signal came).
  std::function<bool()> stopped;
};

/// Meets the other nodes at options.rdzv_host:rdzv_port (for
/// options.assigns_node_ranks(); see Note [fsdprun's rendezvous] in
/// rendezvous.cpp). False with a one-line `error` when the nodes did not all
/// meet within options.join_timeout_s, this node was refused (another
/// FSDP_JOB_TOKEN, --rdzv-id, --nnodes or --nproc-per-node than the serving
/// node's, or one node too many), or hooks.stopped() said so.
bool join_rendezvous(const LaunchOptions& options, const std::string& token, const Hooks& hooks,
                     Assignment* assignment, std::string* error);

// The pieces of node 0's choice of MASTER_ADDR, for tests.

/// An address as it would be written (an IPv4 peer of a dual-stack socket
/// without its "::ffff:").
std::string peer_name(const sockaddr_storage& addr);
/// Where the ranks meet: `host`, unless it names none of node 0's addresses
/// (`endpoint_here` false: --rdzv-conf is_host=1 behind a virtual IP), or
/// only loopback ones (`endpoint`, as resolved there) while the first node
/// to join came from another host (`first_peer`): then node 0's address that
/// node reached (`first_reached`), since the store listens on MASTER_ADDR
/// alone.
std::string meeting_address(const std::string& host, const std::vector<sockaddr_storage>& endpoint,
                            bool endpoint_here, const sockaddr_storage& first_peer,
                            const sockaddr_storage& first_reached);

}  // namespace fsdp::launch
