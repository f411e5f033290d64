#pragma once

// Chooses a rendezvous port for single-node jobs.

#include <string>

namespace fsdp::launch {

/// Returns a TCP port that is free on `addr` (the master address, where rank
/// 0's store will listen: any loopback address, IPv6 too) right now: binds
/// port 0, reads the port the kernel chose and closes the socket (as torchrun
/// does). The port may in principle be taken again before rank 0 binds it;
/// that window is small and the alternative (holding the socket) would block
/// rank 0. Returns -1 and sets `error` when no socket could be bound.
int pick_free_port(const std::string& addr, std::string* error);

}  // namespace fsdp::launch
