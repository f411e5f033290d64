#pragma once

// Rank processes forked from a zygote: Note [Rank processes from a zygote] in
// rank_zygote.cpp.

#include <sys/types.h>

#include <string>
#include <vector>

namespace fsdp::testing {

/// Called first thing in a test program's main(). In the test process it
/// forks the zygote and returns; in a rank process forked from the zygote it
/// returns too, with argc/argv, the environment and stdout/stderr those of the
/// rank (as if the program had been exec'd with them). Does nothing in a
/// process that already has threads, or with FSDP_TEST_ZYGOTE=0.
void start_rank_zygote(int& argc, char**& argv);

/// Starts one rank process: `/proc/self/exe args...` with exactly `env`, its
/// stdout and stderr going to `log_path`. Forked from the zygote where there
/// is one, else fork and exec. Returns its pid, or -1.
pid_t spawn_rank(const std::vector<std::string>& args, const std::vector<std::string>& env,
                 const std::string& log_path);

/// Like waitpid(pid, &status, WNOHANG) for a process from spawn_rank: pid
/// once it has ended (with its wait status in `status`), else 0.
pid_t poll_rank(pid_t pid, int& status);

/// Like waitpid(pid, &status, 0) for a process from spawn_rank.
void wait_rank(pid_t pid, int& status);

}  // namespace fsdp::testing
