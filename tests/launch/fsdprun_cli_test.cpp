// End-to-end: the command line as a user types it.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "device_count.h"
#include "launch_test_util.h"
#include "options.h"

namespace fsdp::launch::testing {
namespace {

TEST(FsdprunCli, HelpMentionsEveryFlag) {
  const RunResult r = run_launcher({"--help"});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0);
  for (const std::string& flag : flag_names()) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  }
}

// torchrun's --nproc-per-node gpu: one rank per GPU the CUDA driver shows
// (CUDA_VISIBLE_DEVICES applied); where it shows none, an error saying so
// and what to give instead, before anything starts.
TEST(FsdprunCli, NprocPerNodeGpuCountsTheVisibleGpus) {
  std::string why;
  const int gpus = visible_cuda_gpus(&why);
  const RunResult r = run_launcher({"--nproc-per-node", "gpu", test_rank_path(), "--print-env"});
  ASSERT_FALSE(r.timed_out);
  if (gpus == 0) {
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("fsdprun: error: --nproc-per-node gpu: no CUDA GPU is visible (" + why +
                         "); give a number of ranks instead"),
              std::string::npos)
        << r.err;
    return;
  }
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(parse_env(r.out).size(), static_cast<size_t>(gpus)) << r.out;
  EXPECT_NE(r.err.find("one per visible CUDA GPU"), std::string::npos) << r.err;
}

TEST(FsdprunCli, BadFlagsExitWithUsageError) {
  struct Case {
    std::vector<std::string> args;
    std::vector<std::string> expected;  ///< Substrings of stderr.
  };
  const std::string prog = test_rank_path();
  const std::vector<Case> cases = {
      {{"--nproc-per-node", "0", prog}, {"--nproc-per-node", "'0'"}},
      {{"--node-rank", "2", "--nnodes", "2", prog}, {"--node-rank", "'2'"}},
      {{"--master-port", "70000", prog}, {"--master-port", "'70000'"}},
      {{"--nproc-per-node", "2"}, {"missing the program"}},
      {{"--frobnicate", prog}, {"unknown flag '--frobnicate'"}},
  };
  for (const Case& c : cases) {
    const RunResult r = run_launcher(c.args);
    ASSERT_FALSE(r.timed_out);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    for (const std::string& text : c.expected) {
      EXPECT_NE(r.err.find(text), std::string::npos)
          << "stderr '" << r.err << "' lacks '" << text << "'";
    }
    EXPECT_NE(r.err.find("--help"), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "");
  }
}

TEST(FsdprunCli, ProgramFlagsPassThroughUntouched) {
  const RunResult r = run_launcher({"--nproc-per-node", "1", test_rank_path(), "--print-argv",
                                    "--nproc-per-node", "5", "--lr", "3"});
  ASSERT_FALSE(r.timed_out) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out,
            "[rank0]: ARGV: --nproc-per-node\n[rank0]: ARGV: 5\n"
            "[rank0]: ARGV: --lr\n[rank0]: ARGV: 3\n");
}

TEST(FsdprunCli, UnderscoreSpellingAndDoubleDash) {
  const RunResult r = run_launcher(
      {"--nproc_per_node=2", "--max_restarts", "1", "--", test_rank_path(), "--print-env"});
  ASSERT_FALSE(r.timed_out) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("[rank1]: WORLD_SIZE=2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank0]: TORCHELASTIC_MAX_RESTARTS=1"), std::string::npos) << r.out;
}

TEST(FsdprunCli, ProgramIsFoundViaPath) {
  const std::string rank = test_rank_path();
  const std::string dir = rank.substr(0, rank.rfind('/'));
  const char* path = std::getenv("PATH");
  const RunResult r =
      run_launcher({"--nproc-per-node", "1", "fsdprun_test_rank", "--print-argv", "ok"},
                   {{"PATH", dir + ":" + (path != nullptr ? path : "/usr/bin:/bin")}});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "[rank0]: ARGV: ok\n");
}

TEST(FsdprunCli, MissingProgramExits127) {
  const RunResult r =
      run_launcher({"--nproc-per-node", "1", "/nonexistent/fsdprun-no-such-program"});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 127) << r.err;
  EXPECT_NE(r.err.find("cannot execute"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("exited with status 127"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace fsdp::launch::testing
