#pragma once

#include <stdexcept>
#include <string>

namespace fsdp {

/// A checkpoint that cannot be written or read: a missing completion marker,
/// a truncated or corrupted file, an inconsistent header. The message names
/// the file and the problem.
///
/// Note [Checkpoint errors without LibTorch]
/// The on-disk layer (safetensors, checksums, manifests) does not depend on
/// LibTorch, so that its parser can be fuzzed as plain C++ (fuzz/). It throws
/// this std::runtime_error instead of a c10::Error; the layers above let it
/// pass through unchanged.
class CheckpointError : public std::runtime_error {
 public:
  /// `file` is the path or name of the file concerned; `problem` says what is wrong.
  CheckpointError(const std::string& file, const std::string& problem)
      : std::runtime_error("fsdp checkpoint: " + file + ": " + problem) {}
};

}  // namespace fsdp
