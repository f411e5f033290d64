#pragma once

// Before any rank starts: can the program be run at all? One line saying
// what to do beats every rank failing at exec with errno's words.

#include <optional>
#include <string>

#include "options.h"

namespace fsdp::launch {

/// Why the ranks could not start.
struct ProgramProblem {
  /// One line naming the program, what is wrong and the fix.
  std::string message;
  /// What a shell would exit with: 127 (not found) or 126 (not executable).
  int exit_code = 0;
};

/// Looks options.command[0] up as execvp will in the ranks: a name with a
/// '/' as it is, else in each directory of `path` (the ranks' PATH; nullopt:
/// unset, glibc's /bin:/usr/bin), relative to the current directory.
/// nullopt when a regular file with execute permission is found.
std::optional<ProgramProblem> check_program(const LaunchOptions& options,
                                            const std::optional<std::string>& path);

}  // namespace fsdp::launch
