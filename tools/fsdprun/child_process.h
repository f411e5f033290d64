#pragma once

// Starting one rank: fork, new process group, parent-death signal, pipes for
// its output, execvp.

#include <sys/types.h>

#include <string>
#include <vector>

#include "signal_pipe.h"

namespace fsdp::launch {

/// A started child. Its pid is also its session and process-group id, so
/// signalling -pid reaches the child and everything it spawned that stayed in
/// its group. Until the child has called setsid() the group does not exist
/// yet; a signal for the group must then go to the pid itself (it is held
/// blocked until the child's dispositions are reset, so it is not lost).
struct SpawnedProcess {
  pid_t pid = -1;
  /// Non-blocking read ends of the child's stdout and stderr pipes; the
  /// caller owns and closes them.
  int stdout_fd = -1;
  int stderr_fd = -1;
};

/// Starts `argv` (argv[0] looked up in PATH, like execvp) with exactly the
/// environment `env` ("KEY=VALUE" entries). The child gets its own session
/// and process group, SIGKILL as parent-death signal (so it cannot outlive
/// fsdprun even if fsdprun is SIGKILLed) and the signal dispositions fsdprun
/// inherited. If exec fails the child reports it on its stderr and exits with
/// 127, as a shell does. Throws std::system_error if pipes or fork fail.
SpawnedProcess spawn_process(const std::vector<std::string>& argv,
                             const std::vector<std::string>& env, const SignalPipe& signals);

}  // namespace fsdp::launch
