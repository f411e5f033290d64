#pragma once

// Writing to fsdprun's own stdout/stderr.

#include <string_view>

namespace fsdp::launch {

/// Writes whole buffers to one of fsdprun's output descriptors.
class OutputWriter {
 public:
  /// `fd` is borrowed (typically 1 or 2), not closed.
  explicit OutputWriter(int fd) : fd_(fd) {}

  /// Writes all of `data`, resuming after partial writes and EINTR and
  /// waiting when a non-blocking descriptor is full. Once the descriptor
  /// fails (e.g. EPIPE after `fsdprun ... | head`), later output is dropped:
  /// losing the launcher's stdout must not stop a training run. False once
  /// it has failed (errno says why, right after the failing call).
  bool write(std::string_view data);

 private:
  int fd_;
  bool broken_ = false;
};

}  // namespace fsdp::launch
