#pragma once

// torchrun's --log-dir, --redirects and --tee: each rank's output in files.

#include <string>

namespace fsdp::launch {

/// Makes a fresh <base>/<run_id>_XXXXXX (base: $TMPDIR or /tmp when empty)
/// and returns it; "" with `error` set when it cannot.
std::string make_run_log_dir(const std::string& base, const std::string& run_id,
                             std::string* error);

/// <run_dir>/attempt_<attempt>/<local_rank>/stdout.log (stream 0) or
/// stderr.log (1): where open_rank_log() writes.
std::string rank_log_path(const std::string& run_dir, int attempt, int local_rank, int stream);

/// Opens <run_dir>/attempt_<attempt>/<local_rank>/stdout.log (stream 0) or
/// stderr.log (1) for writing, making its directories; -1 with `error` set
/// when it cannot.
int open_rank_log(const std::string& run_dir, int attempt, int local_rank, int stream,
                  std::string* error);

}  // namespace fsdp::launch
