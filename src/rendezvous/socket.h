#pragma once

// Thin POSIX socket helpers for the rendezvous store and address selection.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "detail/posix_socket.h"

namespace fsdp::detail {

/// Listens on addr:port (port 0: any free port); returns the socket and sets
/// `bound_port`. Throws a c10::Error naming the address on failure.
UniqueFd listen_tcp(const std::string& addr, int port, int* bound_port);

/// now + `timeout`, or the clock's end where that would overflow (a timeout
/// of milliseconds::max() is none).
std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout);

/// Connects to host:port, retrying until `timeout` (the server may not be up
/// yet, nor its name resolvable). Every address the host resolves to is tried; no attempt outlives
/// the deadline (a silently dropped SYN cannot stall it).
UniqueFd connect_tcp(const std::string& host, int port, std::chrono::milliseconds timeout);

/// Outcome of an I/O with a deadline.
enum class IoResult { kOk, kClosed, kTimedOut };

/// Writes all `n` bytes of a blocking socket unless `deadline` passes first.
IoResult write_all_until(int fd, const void* data, size_t n,
                         std::chrono::steady_clock::time_point deadline);

/// Reads exactly `n` bytes of a blocking socket unless `deadline` passes first.
IoResult read_all_until(int fd, void* data, size_t n,
                        std::chrono::steady_clock::time_point deadline);

/// Writes all `n` bytes; false if the peer is gone.
bool write_all(int fd, const void* data, size_t n);

/// Reads exactly `n` bytes; false on EOF or error.
bool read_all(int fd, void* data, size_t n);

/// The local address of the interface the kernel would route to `host` through
/// (no packet is sent). Used to pick what Gloo listens on in multi-node jobs.
std::string local_address_toward(const std::string& host);

}  // namespace fsdp::detail
