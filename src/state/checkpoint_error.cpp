#include <fsdp/state/error.h>

// Only the header-only error_prefix(): this file is part of the fuzz target,
// which does not link LibTorch (see Note [Checkpoint errors without LibTorch]).
#include "detail/error.h"

namespace fsdp {

CheckpointError::CheckpointError(const std::string& file, const std::string& problem)
    : std::runtime_error(detail::error_prefix(-1, file) + problem),
      file_(file),
      problem_(problem) {}

}  // namespace fsdp
