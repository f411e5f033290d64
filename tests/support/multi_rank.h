#pragma once

// Multi-rank tests as real processes. run_ranks() in the test process starts
// world_size processes of the test program that run only the current test,
// with the torchrun environment set (forked from a zygote where it can: Note
// [Rank processes from a zygote] in rank_zygote.cpp); in those the same
// run_ranks() call runs `body` and exits. A rank that fails, crashes or
// hangs fails the test: after the first failure the others get a grace
// period, and every rank is killed at the deadline, so a test never hangs.

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "free_port.h"

namespace fsdp::testing {

/// How one rank process ended.
struct RankOutcome {
  int rank = 0;
  int exit_code = -1;   // when it exited
  int term_signal = 0;  // when a signal ended it
  bool killed_at_deadline = false;
  std::string output;  // its stdout and stderr
};

/// Settings of one multi-rank run.
struct MultiRankOptions {
  /// Every rank is SIGKILLed when this passes.
  std::chrono::seconds deadline{90};
  /// After the first rank fails, the others get this long before SIGKILL.
  std::chrono::seconds failure_grace{15};
  /// Extra environment for every rank.
  std::map<std::string, std::string> env;
};

/// In the test process: runs `body(rank, world_size)` in world_size fresh
/// processes and returns how each ended. In a rank process: runs the body of
/// the matching call and exits (status 0 only if no gtest assertion failed).
std::vector<RankOutcome> run_ranks(int world_size, const std::function<void(int, int)>& body,
                                   const MultiRankOptions& options = {});

/// Adds a gtest failure, with the rank's output, for each rank that did not exit 0.
void expect_all_succeeded(const std::vector<RankOutcome>& outcomes);

/// run_ranks() then expect_all_succeeded().
void run_ranks_ok(int world_size, const std::function<void(int, int)>& body,
                  const MultiRankOptions& options = {});

/// True inside a rank process.
bool is_rank_process();

/// A directory the test process makes (/tmp/fsdp_<name>_XXXXXX) and its rank
/// processes share, passed to them through `options`' environment; "" if it
/// could not be made. The caller removes it after the run.
std::string shared_temp_dir(MultiRankOptions& options, const std::string& name);

/// Text describing an outcome, for assertion messages.
std::string describe(const RankOutcome& outcome);

}  // namespace fsdp::testing
