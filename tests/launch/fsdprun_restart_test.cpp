// End-to-end: --max-restarts.

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "launch_test_util.h"

namespace fsdp::launch::testing {
namespace {

TEST(FsdprunRestart, SucceedsAfterOneRestart) {
  // Every rank fails with 5 on the first attempt only.
  const RunResult r =
      run_launcher({"--nproc-per-node", "2", "--max-restarts", "2", test_rank_path(), "--print-env",
                    "--exit-code-if-restart-below", "1:5"},
                   {{"OMP_NUM_THREADS", "1"}});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count_occurrences(r.err, "exited with status 5"), 1) << r.err;
  EXPECT_NE(r.err.find("fsdprun: restarting all ranks (restart 1/2)"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("restart 2/2"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("[rank0]: TORCHELASTIC_RESTART_COUNT=1"), std::string::npos);
  EXPECT_NE(r.out.find("[rank1]: TORCHELASTIC_RESTART_COUNT=1"), std::string::npos);
  EXPECT_NE(r.out.find("[rank0]: TORCHELASTIC_MAX_RESTARTS=2"), std::string::npos);
  // One job, one token (Note [Job token]): every rank of every attempt that
  // printed its environment (a rank stopped early may not have) shows the same.
  std::set<std::string> tokens;
  for (size_t at = r.out.find("FSDP_JOB_TOKEN="); at != std::string::npos;
       at = r.out.find("FSDP_JOB_TOKEN=", at + 1)) {
    tokens.insert(r.out.substr(at, r.out.find('\n', at) - at));
  }
  EXPECT_EQ(tokens.size(), 1u) << r.out;
}

TEST(FsdprunRestart, GivesUpAfterMaxRestarts) {
  // Rank 0 always fails; rank 1 would sleep forever and must be stopped
  // before every restart.
  const RunResult r =
      run_launcher({"--nproc-per-node", "2", "--max-restarts", "2", test_rank_path(),
                    "--exit-code-on-rank", "0:4", "--sleep", "inf"},
                   {{"OMP_NUM_THREADS", "1"}});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 4) << r.err;
  // Each attempt's failure, and the last one again in the final line.
  EXPECT_EQ(count_occurrences(r.err, "stopping the other ranks"), 3) << r.err;
  EXPECT_EQ(count_occurrences(r.err, "exited with status 4"), 4) << r.err;
  EXPECT_NE(r.err.find("giving up after 2 restarts; the last failure: rank 0 (local rank 0, pid "),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("restart 1/2"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("restart 2/2"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("restart 3/2"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("giving up"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace fsdp::launch::testing
