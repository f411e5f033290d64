// End-to-end: rank failures, forwarded signals and the no-orphans guarantee.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "launch_test_util.h"

namespace fsdp::launch::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

/// Upper bound for any single launcher run in these tests.
constexpr seconds kRunTimeout{20};
/// Upper bound for ranks to start and write their pid files.
constexpr seconds kStartTimeout{10};

/// Expects every pid recorded in `dir` to be gone right now: fsdprun must
/// have reaped them before it exited.
void expect_all_gone(const PidDir& dir, size_t expected_count) {
  const std::vector<pid_t> pids = dir.all_pids();
  EXPECT_EQ(pids.size(), expected_count);
  for (pid_t pid : pids) EXPECT_TRUE(process_gone(pid)) << "pid " << pid;
}

TEST(FsdprunFailure, RankExitStatusStopsTheOthers) {
  PidDir dir;
  const RunResult r =
      run_launcher({"--nproc-per-node", "3", test_rank_path(), "--write-pid-dir", dir.path(),
                    "--barrier", "--exit-code-on-rank", "1:3", "--sleep", "inf"},
                   {}, kRunTimeout);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 3) << r.err;
  const auto pid1 = dir.read("1.pid");
  ASSERT_TRUE(pid1.has_value());
  EXPECT_NE(
      r.err.find("rank 1 (local rank 1, pid " + std::to_string(*pid1) + ") exited with status 3"),
      std::string::npos)
      << r.err;
  expect_all_gone(dir, 3);
  // The sleeping ranks honour SIGTERM: no need to wait for the kill timeout.
  EXPECT_LT(r.elapsed, seconds(8));
}

TEST(FsdprunFailure, RankKilledBySignal) {
  PidDir dir;
  const RunResult r =
      run_launcher({"--nproc-per-node", "2", test_rank_path(), "--write-pid-dir", dir.path(),
                    "--barrier", "--kill-self-on-rank", "0:9", "--sleep", "inf"},
                   {}, kRunTimeout);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.err;
  EXPECT_NE(r.err.find("rank 0 (local rank 0, pid "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << r.err;
  expect_all_gone(dir, 2);
}

TEST(FsdprunFailure, RankIgnoringSigtermIsKilledAfterTimeout) {
  PidDir dir;
  const RunResult r = run_launcher(
      {"--nproc-per-node", "2", "--kill-timeout", "1", test_rank_path(), "--ignore-sigterm",
       "--write-pid-dir", dir.path(), "--barrier", "--exit-code-on-rank", "0:3", "--sleep", "inf"},
      {}, kRunTimeout);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("rank 0 (local rank 0"), std::string::npos) << r.err;
  // The forced kill is said (torchrun: "forcefully exiting via SIGKILL"),
  // and the last line names the failure again, after the other rank's
  // output, as torchrun's summary does.
  EXPECT_NE(r.err.find("fsdprun: local rank 1 (pid "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(") still running 1 s after SIGTERM; sending SIGKILL"), std::string::npos)
      << r.err;
  const auto last = r.err.rfind("fsdprun: job failed: rank 0 (local rank 0, pid ");
  EXPECT_NE(last, std::string::npos) << r.err;
  EXPECT_EQ(r.err.find('\n', last), r.err.size() - 1) << "not the last line:\n" << r.err;
  EXPECT_GE(r.elapsed, milliseconds(900));
  EXPECT_LT(r.elapsed, seconds(8));
  expect_all_gone(dir, 2);
}

// A rank that outlives SIGKILL (stuck in the kernel: a GPU or network
// driver call; here SIGKILL does not reach it, FSDP_FAULT_SIGKILL_MISSES) is
// left after 10 s, said, and the job ends with the failure's status and no
// restart, though restarts were allowed: the stuck rank may still hold the
// GPU and the port.
TEST(FsdprunFailure, ARankThatOutlivesSigkillIsLeftWithoutARestart) {
  PidDir dir;
  const RunResult r =
      run_launcher({"--nproc-per-node", "2", "--max-restarts", "2", "--kill-timeout", "1",
                    test_rank_path(), "--ignore-sigterm", "--write-pid-dir", dir.path(),
                    "--barrier", "--exit-code-on-rank", "0:3", "--sleep", "inf"},
                   {{"FSDP_FAULT_SIGKILL_MISSES", "1"}}, seconds(40));
  const auto stuck = dir.read("1.pid");
  if (stuck) ::kill(*stuck, SIGKILL);  // what the kernel would do at last
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("did not exit 10 s after SIGKILL (stuck in the kernel"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("leaving it and ending, without a restart"), std::string::npos) << r.err;
  EXPECT_EQ(count_occurrences(r.err, "stopping the other ranks"), 1) << "restarted: " << r.err;
  EXPECT_NE(r.err.find("fsdprun: job failed, without a restart (a rank outlived SIGKILL): rank 0"),
            std::string::npos)
      << r.err;
  EXPECT_GE(r.elapsed, seconds(10));
  ASSERT_TRUE(stuck.has_value());
  EXPECT_TRUE(wait_gone(*stuck, std::chrono::milliseconds(5000)));
}

// A rank's failure is said at once, not after the other ranks stopped (up
// to the shutdown timeout), and a Ctrl-C in that time keeps it the news:
// the failed rank named, its exit code, no restart (a review found only
// "stopped by SIGINT" and 130). As torchrun's summary, the line says where
// and when (the node, its host, the time) and which file has the rank's
// stderr.
TEST(FsdprunFailure, AFailureIsSaidAtOnceAndOutlivesALaterSignal) {
  PidDir dir;
  LauncherProcess launcher({"--nproc-per-node", "2", "--max-restarts", "2", "--kill-timeout", "30",
                            "--log-dir", dir.path() + "/logs", "--redirects", "2", test_rank_path(),
                            "--ignore-sigterm", "--write-pid-dir", dir.path(), "--barrier",
                            "--exit-code-on-rank", "1:3", "--sleep", "inf"});
  const std::string failed = "rank 1 (local rank 1, pid ";
  ASSERT_TRUE(launcher.pump_until(
      [&] { return launcher.err().find("exited with status 3") != std::string::npos; },
      kStartTimeout))
      << launcher.err();
  EXPECT_NE(launcher.err().find(failed), std::string::npos) << launcher.err();
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  EXPECT_NE(launcher.err().find(std::string("(node 0, host ") + host + ", at 20"),
            std::string::npos)
      << launcher.err();
  EXPECT_NE(launcher.err().find("its stderr: " + dir.path() + "/logs/"), std::string::npos)
      << launcher.err();
  EXPECT_NE(launcher.err().find("/attempt_0/1/stderr.log"), std::string::npos) << launcher.err();
  launcher.send_signal(SIGINT);
  const RunResult r = launcher.wait(kRunTimeout);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 3) << r.err;
  // Said at once and again in the last line; a restart would say it anew.
  EXPECT_EQ(count_occurrences(r.err, "exited with status 3"), 2) << "restarted: " << r.err;
  EXPECT_EQ(count_occurrences(r.err, "stopping the other ranks"), 1) << "restarted: " << r.err;
  EXPECT_NE(r.err.find("stopped by SIGINT after that failure: " + failed), std::string::npos)
      << r.err;
}

/// Expects every rank in [0, count) to have recorded `signo`
/// (fsdprun_test_rank --record-signals).
void expect_ranks_got(const PidDir& dir, int count, int signo) {
  for (int rank = 0; rank < count; ++rank) {
    EXPECT_EQ(dir.read(std::to_string(rank) + ".signal"), std::optional<pid_t>(signo))
        << "rank " << rank;
  }
}

/// Forwarding of each termination signal fsdprun handles by default, as
/// torchrun's --signals-to-handle default: SIGTERM, SIGINT, SIGHUP, SIGQUIT.
class FsdprunSignalForwarding : public ::testing::TestWithParam<int> {};

TEST_P(FsdprunSignalForwarding, EndsEveryRank) {
  const int signo = GetParam();
  PidDir dir;
  LauncherProcess launcher({"--nproc-per-node", "3", test_rank_path(), "--record-signals",
                            "--write-pid-dir", dir.path(), "--sleep", "inf"});
  ASSERT_TRUE(
      launcher.pump_until([&] { return dir.has_all(rank_pid_files(0, 3)); }, kStartTimeout));
  launcher.send_signal(signo);
  const RunResult r = launcher.wait(kRunTimeout);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 128 + signo) << r.err;
  expect_ranks_got(dir, 3, signo);
  expect_all_gone(dir, 3);
}

INSTANTIATE_TEST_SUITE_P(Signals, FsdprunSignalForwarding,
                         ::testing::Values(SIGTERM, SIGINT, SIGHUP, SIGQUIT),
                         [](const ::testing::TestParamInfo<int>& info) {
                           switch (info.param) {
                             case SIGTERM:
                               return std::string("SIGTERM");
                             case SIGINT:
                               return std::string("SIGINT");
                             case SIGQUIT:
                               return std::string("SIGQUIT");
                             default:
                               return std::string("SIGHUP");
                           }
                         });

// torchrun's --signals-to-handle: SLURM's SIGUSR1 (sent before a job's time
// is up) reaches every rank, which then stop.
TEST(FsdprunSignals, SignalsToHandleForwardsTheSignalsNamed) {
  PidDir dir;
  LauncherProcess launcher({"--nproc-per-node", "2", "--signals-to-handle", "SIGUSR1,SIGTERM",
                            test_rank_path(), "--record-signals", "--write-pid-dir", dir.path(),
                            "--sleep", "inf"});
  ASSERT_TRUE(
      launcher.pump_until([&] { return dir.has_all(rank_pid_files(0, 2)); }, kStartTimeout));
  launcher.send_signal(SIGUSR1);
  const RunResult r = launcher.wait(kRunTimeout);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 128 + SIGUSR1) << r.err;
  EXPECT_NE(r.err.find("received SIGUSR1; forwarding it to all ranks"), std::string::npos) << r.err;
  expect_ranks_got(dir, 2, SIGUSR1);
  expect_all_gone(dir, 2);
}

// The grace before SIGKILL is torchrun's --shutdown-timeout, else
// TORCH_ELASTIC_SHUTDOWN_TIMEOUT (else 30 s, which no test waits for).
TEST(FsdprunSignals, ShutdownTimeoutFromTheFlagOrTheEnvironment) {
  const std::vector<std::vector<std::string>> flags = {{"--shutdown-timeout", "0.5"}, {}};
  for (const std::vector<std::string>& flag : flags) {
    SCOPED_TRACE(flag.empty() ? "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" : flag[0]);
    PidDir dir;
    std::vector<std::string> args = {"--nproc-per-node", "2"};
    args.insert(args.end(), flag.begin(), flag.end());
    for (const std::string& arg :
         {test_rank_path(), std::string("--ignore-sigterm"), std::string("--write-pid-dir"),
          dir.path(), std::string("--sleep"), std::string("inf")}) {
      args.push_back(arg);
    }
    LauncherProcess launcher(args, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                                     flag.empty() ? std::optional<std::string>("0.5")
                                                  : std::optional<std::string>("600")}});
    ASSERT_TRUE(
        launcher.pump_until([&] { return dir.has_all(rank_pid_files(0, 2)); }, kStartTimeout));
    const auto signalled = std::chrono::steady_clock::now();
    launcher.send_signal(SIGTERM);
    const RunResult r = launcher.wait(kRunTimeout);
    const auto took = std::chrono::steady_clock::now() - signalled;
    ASSERT_FALSE(r.timed_out) << r.err;
    EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.err;
    EXPECT_GE(took, milliseconds(400));
    EXPECT_LT(took, seconds(8));
    expect_all_gone(dir, 2);
  }
}

TEST(FsdprunSignals, SigkillOfLauncherStillKillsRanks) {
  // Ranks orphaned by the SIGKILL are reparented to this test process, so it
  // can reap them instead of leaving zombies to an init that may not.
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  PidDir dir;
  LauncherProcess launcher(
      {"--nproc-per-node", "3", test_rank_path(), "--write-pid-dir", dir.path(), "--sleep", "inf"});
  ASSERT_TRUE(
      launcher.pump_until([&] { return dir.has_all(rank_pid_files(0, 3)); }, kStartTimeout));
  launcher.send_signal(SIGKILL);
  const RunResult r = launcher.wait(kRunTimeout);
  ASSERT_FALSE(r.timed_out);
  EXPECT_TRUE(WIFSIGNALED(r.wait_status));
  for (pid_t pid : dir.all_pids()) {
    EXPECT_TRUE(wait_gone(pid, seconds(5))) << "pid " << pid;
  }
  ::prctl(PR_SET_CHILD_SUBREAPER, 0);
}

TEST(FsdprunSignals, GrandchildInRankGroupGoesOnSigterm) {
  PidDir dir;
  LauncherProcess launcher({"--nproc-per-node", "2", test_rank_path(), "--spawn-grandchild",
                            "--write-pid-dir", dir.path(), "--sleep", "inf"});
  // Rank pid files are written after the grandchild's.
  ASSERT_TRUE(
      launcher.pump_until([&] { return dir.has_all(rank_pid_files(0, 2)); }, kStartTimeout));
  launcher.send_signal(SIGTERM);
  const RunResult r = launcher.wait(kRunTimeout);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.err;
  ASSERT_TRUE(dir.read("0.grandchild.pid").has_value());
  ASSERT_TRUE(dir.read("1.grandchild.pid").has_value());
  expect_all_gone(dir, 4);
}

TEST(FsdprunOrphans, GrandchildOfSuccessfulRankIsStopped) {
  PidDir dir;
  const RunResult r = run_launcher({"--nproc-per-node", "1", test_rank_path(), "--spawn-grandchild",
                                    "--write-pid-dir", dir.path()},
                                   {}, kRunTimeout);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 0) << r.err;
  ASSERT_TRUE(dir.read("0.grandchild.pid").has_value());
  expect_all_gone(dir, 2);
}

}  // namespace
}  // namespace fsdp::launch::testing
