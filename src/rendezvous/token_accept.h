#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "rendezvous/socket.h"

namespace fsdp::detail {

/// Accepts connections on `listen_fd` until one presents `token` (see Note
/// [Job token]) and returns it, blocking again, with the handshake answered.
/// Handshakes run side by side, each bounded by kHandshakeTimeout, so a silent
/// connection delays no other; every other connection is refused, counted and
/// closed (those still mid-handshake when one succeeds too). Returns an empty
/// UniqueFd when `deadline` passes first. `rank` and `listener` name this side
/// in the refusal log line.
UniqueFd accept_with_token(int listen_fd, const std::string& token,
                           std::chrono::steady_clock::time_point deadline, int64_t rank,
                           const char* listener);

}  // namespace fsdp::detail
