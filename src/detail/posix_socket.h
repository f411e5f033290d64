#pragma once

// Socket pieces that depend on nothing but libc, shared by libfsdp's
// rendezvous (src/rendezvous/socket.h) and fsdprun, which links no LibTorch.

#include <sys/socket.h>

#include <string>

namespace fsdp::detail {

/// Owns a file descriptor; closes it on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  /// The descriptor, or -1.
  int get() const { return fd_; }
  /// Whether it holds a descriptor.
  bool valid() const { return fd_ >= 0; }
  /// Gives up ownership.
  int release();
  /// Closes the descriptor (if any).
  void reset();

 private:
  int fd_ = -1;
};

/// Whether `addr` is a loopback address (127/8, ::1, IPv4-mapped 127/8).
bool is_loopback(const sockaddr_storage& addr);

/// The same for a numeric address in any spelling, or "localhost".
bool is_loopback_host(const std::string& host);

}  // namespace fsdp::detail
