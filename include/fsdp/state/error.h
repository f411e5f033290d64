#pragma once

#include <stdexcept>
#include <string>

namespace fsdp {

/// A checkpoint that cannot be written or read: a missing completion marker,
/// a truncated or corrupted file, an inconsistent header. what() reads
/// "[rank R] fsdp(<file>): <problem>" (see Note [Error messages]).
///
/// Note [Checkpoint errors without LibTorch]
/// The on-disk layer (safetensors, checksums, manifests) does not link
/// LibTorch, so that its parser can be fuzzed as plain C++ (fuzz/). It throws
/// this std::runtime_error instead of a c10::Error; the layers above let it
/// pass through unchanged. Its prefix is Note [Error messages]'s, with the
/// launcher's rank (RANK) as the rank.
class CheckpointError : public std::runtime_error {
 public:
  /// `file` is the path or name of the file concerned; `problem` says what is
  /// wrong (and, where there is one, the fix).
  CheckpointError(const std::string& file, const std::string& problem);
  /// The file concerned.
  const std::string& file() const { return file_; }
  /// What is wrong, without the prefix.
  const std::string& problem() const { return problem_; }

 private:
  std::string file_;
  std::string problem_;
};

}  // namespace fsdp
