// End-to-end: the command line as a user types it.

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
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

// A program that cannot be run is one line before any rank starts, with a
// shell's status: 127 not found, 126 not executable.
TEST(FsdprunCli, MissingProgramExits127) {
  const RunResult r =
      run_launcher({"--nproc-per-node", "2", "/nonexistent/fsdprun-no-such-program"});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 127) << r.err;
  EXPECT_EQ(r.err,
            "fsdprun: error: cannot execute '/nonexistent/fsdprun-no-such-program': no such "
            "file\n");
}

TEST(FsdprunCli, AProgramWithoutTheExecuteBitSaysSo) {
  PidDir dir;  // a scratch directory
  const std::string program = dir.path() + "/train";
  { std::ofstream(program) << "#!/bin/sh\n"; }
  const RunResult r = run_launcher({program});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 126) << r.err;
  EXPECT_EQ(r.err, "fsdprun: error: cannot execute '" + program +
                       "': it lacks the execute permission; chmod +x " + program + "\n");
}

/// Whether `name` is an executable in PATH.
bool in_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (!dir.empty() && ::access((dir + "/" + name).c_str(), X_OK) == 0) return true;
  }
  return false;
}

// As torchrun, a .py script runs as `python3 -u SCRIPT` (PYTHON_EXEC
// chooses the interpreter), with no execute bit needed; --no-python runs
// it itself, and then needs one.
TEST(FsdprunCli, APythonScriptRunsThroughPython) {
  if (!in_path("python3")) GTEST_SKIP() << "no python3 in PATH";
  PidDir dir;
  const std::string script = dir.path() + "/train.py";
  {
    std::ofstream(script) << "import os, sys\n"
                             "print('rank', os.environ['RANK'], 'unbuffered',\n"
                             "      sys.stdout.write_through, sys.argv[1:])\n";
  }
  // Unbuffered by -u alone.
  const std::map<std::string, std::optional<std::string>> env = {
      {"PYTHONUNBUFFERED", std::nullopt}};
  RunResult r = run_launcher({"--nproc-per-node", "2", script, "--lr", "3"}, env);
  ASSERT_FALSE(r.timed_out) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("[rank0]: rank 0 unbuffered True ['--lr', '3']\n"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("[rank1]: rank 1 unbuffered True ['--lr', '3']\n"), std::string::npos)
      << r.out;

  // The script in the current directory, named as torchrun's users name it.
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof(cwd)), nullptr);
  ASSERT_EQ(::chdir(dir.path().c_str()), 0);
  r = run_launcher({"train.py"}, env);
  ASSERT_EQ(::chdir(cwd), 0);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "[rank0]: rank 0 unbuffered True []\n");

  // Across nodes under the static backend, as torchrun runs it: no
  // FSDP_JOB_TOKEN needed (torch.distributed reads none; it was refused).
  r = run_launcher({"--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", script},
                   {{"FSDP_JOB_TOKEN", std::nullopt}, {"PYTHONUNBUFFERED", std::nullopt}});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "[rank1]: rank 1 unbuffered True []\n") << r.err;

  r = run_launcher({script}, {{"PYTHON_EXEC", dir.path() + "/no-such-python"}});
  EXPECT_EQ(r.exit_code, 127) << r.err;
  EXPECT_NE(r.err.find("to run " + script + " as torchrun does: no such file; set PYTHON_EXEC"),
            std::string::npos)
      << r.err;

  r = run_launcher({"--no-python", script});
  EXPECT_EQ(r.exit_code, 126) << r.err;
  EXPECT_NE(r.err.find("or drop --no-python to run it as python3 -u " + script), std::string::npos)
      << r.err;
}

// torchrun's PET_<FLAG> variables are the flags' defaults; the command line wins.
TEST(FsdprunCli, PetVariablesStandForFlags) {
  const std::map<std::string, std::optional<std::string>> env = {{"PET_NNODES", "1"},
                                                                 {"PET_NPROC_PER_NODE", "2"}};
  RunResult r = run_launcher({test_rank_path(), "--print-env"}, env);
  ASSERT_FALSE(r.timed_out) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(parse_env(r.out).size(), 2u) << r.out;

  r = run_launcher({"--nproc-per-node", "3", test_rank_path(), "--print-env"}, env);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(parse_env(r.out).size(), 3u) << r.out;

  r = run_launcher({test_rank_path()}, {{"PET_NPROC_PER_NODE", "two"}});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("fsdprun: error: PET_NPROC_PER_NODE: invalid value 'two'"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace fsdp::launch::testing
