#pragma once

// Describing how a rank ended, for messages and fsdprun's own exit code.

#include <string>

namespace fsdp::launch {

/// The short name of a signal, e.g. "SIGKILL"; "SIG<n>" for unknown ones.
std::string signal_name(int signo);

/// The number of a signal named as signal_name() names it ("SIGTERM"), or 0.
int signal_number(const std::string& name);

/// "exited with status 3" or "was killed by signal 9 (SIGKILL)" for a
/// waitpid() status.
std::string describe_wait_status(int wait_status);

/// The exit code fsdprun uses for a rank that ended with `wait_status`: its
/// exit status, or 128 + signal number like a shell.
int exit_code_for(int wait_status);

/// True when the status means success (normal exit with status 0).
bool is_success(int wait_status);

}  // namespace fsdp::launch
