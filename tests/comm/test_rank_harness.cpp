// The multi-rank harness itself (tests/support): a rank process starts with
// the environment, thread counts and output of an exec'd one, and a rank that
// fails, crashes or hangs is reported as such, with the zygote (Note [Rank
// processes from a zygote]) and without it (ctest entry
// test_rank_harness_exec, FSDP_TEST_ZYGOTE=0).

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include "multi_rank.h"

namespace fsdp::testing {
namespace test_rank_harness {

using Clock = std::chrono::steady_clock;

TEST(RankHarness, RanksStartWithTheirOwnEnvironmentThreadsAndOutput) {
  // Set after the test program started (and its zygote with it): a rank sees
  // the environment of the moment it is started, as exec would give it.
  ::setenv("FSDP_TEST_SET_LATE", "late", 1);
  MultiRankOptions options;
  options.env["FSDP_TEST_FROM_OPTIONS"] = "given";
  const auto outcomes = run_ranks(
      3,
      [](int rank, int world) {
        EXPECT_EQ(std::getenv("RANK"), std::to_string(rank));
        EXPECT_EQ(std::getenv("WORLD_SIZE"), std::to_string(world));
        EXPECT_STREQ(std::getenv("FSDP_TEST_SET_LATE"), "late");
        EXPECT_STREQ(std::getenv("FSDP_TEST_FROM_OPTIONS"), "given");
        // The harness gives ranks OMP_NUM_THREADS=1: LibTorch's pool, and
        // OpenBLAS's where LibTorch links it, must have read it.
        EXPECT_EQ(at::get_num_threads(), 1);
        using Get = int (*)();
        if (auto get = reinterpret_cast<Get>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads")))
          EXPECT_EQ(get(), 1);
        std::cout << "stdout of rank " << rank << std::endl;
        std::cerr << "stderr of rank " << rank << std::endl;
      },
      options);
  ::unsetenv("FSDP_TEST_SET_LATE");
  expect_all_succeeded(outcomes);
  for (const auto& o : outcomes) {
    EXPECT_NE(o.output.find("stdout of rank " + std::to_string(o.rank)), std::string::npos)
        << describe(o);
    EXPECT_NE(o.output.find("stderr of rank " + std::to_string(o.rank)), std::string::npos)
        << describe(o);
  }
}

// Set by the test process only: a rank must not start from its state.
int g_test_process_state = 0;

TEST(RankHarness, RanksStartFreshNotFromTheTestProcess) {
  if (!is_rank_process()) g_test_process_state = 42;
  MultiRankOptions options;
  options.env["FSDP_TEST_PROCESS_PID"] = std::to_string(::getpid());
  const auto outcomes = run_ranks(
      2,
      [](int, int) {
        EXPECT_NE(std::to_string(::getpid()), std::getenv("FSDP_TEST_PROCESS_PID"));
        EXPECT_EQ(g_test_process_state, 0);
      },
      options);
  expect_all_succeeded(outcomes);
}

TEST(RankHarness, FailuresCrashesAndHangsAreReported) {
  const auto start = Clock::now();
  // Ranks 1 and 2 fail only once rank 0 has finished: exec'd ranks under a
  // sanitizer on a loaded machine start seconds apart, and a rank still
  // starting when the grace ends is killed, which is right but not this test.
  // Made once, by the test process (a rank process runs the test from its
  // start too, and left a directory behind when each made its own).
  MultiRankOptions options;
  const std::string dir = shared_temp_dir(options, "harness");
  ASSERT_FALSE(dir.empty());
  const std::string done = dir + "/rank0_done";
  options.deadline = std::chrono::seconds(60);
  options.failure_grace = std::chrono::seconds(3);
  options.env["FSDP_TEST_RANK0_DONE"] = done;
  const auto outcomes = run_ranks(
      4,
      [](int rank, int) {
        const std::string done_file = std::getenv("FSDP_TEST_RANK0_DONE");
        if (rank == 0) {
          std::ofstream(done_file) << "done";
          return;
        }
        while (!std::ifstream(done_file).good())
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (rank == 1) ADD_FAILURE() << "rank 1 fails an assertion";
        if (rank == 2) ::raise(SIGABRT);
        if (rank == 3) std::this_thread::sleep_for(std::chrono::minutes(5));
      },
      options);
  std::remove(done.c_str());
  ::rmdir(dir.c_str());
  ASSERT_EQ(outcomes.size(), 4u);
  EXPECT_EQ(outcomes[0].exit_code, 0) << describe(outcomes[0]);
  EXPECT_EQ(outcomes[1].exit_code, 1) << describe(outcomes[1]);
  EXPECT_NE(outcomes[1].output.find("rank 1 fails an assertion"), std::string::npos)
      << describe(outcomes[1]);
  EXPECT_EQ(outcomes[2].term_signal, SIGABRT) << describe(outcomes[2]);
  EXPECT_TRUE(outcomes[3].killed_at_deadline) << describe(outcomes[3]);
  // The hung rank is killed at the end of the grace after the first failure,
  // not at the deadline.
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(40));
}

}  // namespace test_rank_harness
}  // namespace fsdp::testing
