// End-to-end: how ranks' output is relayed.

#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <string>

#include "launch_test_util.h"

namespace fsdp::launch::testing {
namespace {

/// Lines printed per rank by the interleaving test: enough that the ranks'
/// output overlaps in time and pipe reads split lines.
constexpr int kLinesPerRank = 2000;
/// Stop reporting bad lines after this many; one is enough to diagnose.
constexpr int kMaxReportedBadLines = 5;

/// Checks stdout of `ranks` ranks run with --lines N --partial-line: every
/// line is whole, carries its own rank's "[rankN]: " prefix when `prefixed`,
/// and each rank's lines arrive in order, followed by its flushed partial
/// line.
void check_stdout(const std::string& out, bool prefixed, int ranks, int lines_per_rank) {
  const std::string prefix = prefixed ? R"(\[rank(\d+)\]: )" : "()";
  const std::regex line_re("^" + prefix + R"(line (\d+) of rank (\d+) x{100}$)");
  const std::regex tail_re("^" + prefix + R"(tail of rank (\d+)$)");
  std::map<int, int> next_line;
  std::map<int, int> tails;
  int bad = 0;
  for (const std::string& line : split_lines(out)) {
    std::smatch m;
    if (std::regex_match(line, m, line_re)) {
      const int rank = std::stoi(m[3]);
      if (prefixed) EXPECT_EQ(m[1], m[3]) << line;
      EXPECT_EQ(std::stoi(m[2]), next_line[rank]) << line;
      EXPECT_EQ(tails[rank], 0) << "line after the partial line: " << line;
      next_line[rank] = std::stoi(m[2]) + 1;
    } else if (std::regex_match(line, m, tail_re)) {
      const int rank = std::stoi(m[2]);
      if (prefixed) EXPECT_EQ(m[1], m[2]) << line;
      ++tails[rank];
    } else if (++bad <= kMaxReportedBadLines) {
      ADD_FAILURE() << "malformed or interleaved line: '" << line << "'";
    }
  }
  EXPECT_EQ(bad, 0);
  for (int rank = 0; rank < ranks; ++rank) {
    EXPECT_EQ(next_line[rank], lines_per_rank) << "rank " << rank;
    EXPECT_EQ(tails[rank], 1) << "rank " << rank;
  }
}

TEST(FsdprunOutput, LinesArePrefixedWholeAndOnTheRightStream) {
  const RunResult r =
      run_launcher({"--nproc-per-node", "3", test_rank_path(), "--lines",
                    std::to_string(kLinesPerRank), "--stderr-lines", "50", "--partial-line"},
                   {{"OMP_NUM_THREADS", "1"}});
  ASSERT_FALSE(r.timed_out) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  check_stdout(r.out, /*prefixed=*/true, 3, kLinesPerRank);
  EXPECT_EQ(r.out.find("err "), std::string::npos);

  const std::regex err_re(R"(^\[rank(\d)\]: err (\d+) of rank (\d)$)");
  std::map<int, int> err_lines;
  for (const std::string& line : split_lines(r.err)) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, err_re)) << line;
    EXPECT_EQ(m[1], m[3]);
    ++err_lines[std::stoi(m[1])];
  }
  for (int rank = 0; rank < 3; ++rank) EXPECT_EQ(err_lines[rank], 50);
}

// A line a rank leaves unfinished (a prompt) is shown, prefixed, while the
// rank waits (it was held until the line ended, or the rank exited).
TEST(FsdprunOutput, AnUnfinishedLineIsShownWhileTheRankWaits) {
  LauncherProcess launcher(
      {"--nproc-per-node", "1", test_rank_path(), "--partial-line", "--sleep", "30"},
      {{"OMP_NUM_THREADS", "1"}});
  EXPECT_TRUE(launcher.pump_until(
      [&] { return launcher.out().find("[rank0]: tail of rank 0") != std::string::npos; },
      std::chrono::seconds(10)))
      << launcher.out();
}

TEST(FsdprunOutput, NoPrefix) {
  const RunResult r = run_launcher({"--nproc-per-node", "2", "--no-prefix", test_rank_path(),
                                    "--lines", "200", "--partial-line"},
                                   {{"OMP_NUM_THREADS", "1"}});
  ASSERT_FALSE(r.timed_out) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find("[rank"), std::string::npos);
  check_stdout(r.out, /*prefixed=*/false, 2, 200);
}

// torchrun's --log-line-prefix-template in place of "[rank<N>]: ".
TEST(FsdprunOutput, LogLinePrefixTemplate) {
  const RunResult r =
      run_launcher({"--nproc-per-node", "2", "--role", "trainer", "--log-line-prefix-template",
                    "${role_name}:${rank}/$local_rank $$ ", test_rank_path(), "--print-argv", "x"},
                   {{"OMP_NUM_THREADS", "1"}});
  ASSERT_FALSE(r.timed_out) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("trainer:0/0 $ ARGV: x\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("trainer:1/1 $ ARGV: x\n"), std::string::npos) << r.out;
}

// torchrun's --local-ranks-filter: only the local ranks named are shown,
// both streams; the others still run to the end.
TEST(FsdprunOutput, LocalRanksFilterShowsOnlyTheRanksNamed) {
  const RunResult r = run_launcher({"--nproc-per-node", "3", "--local-ranks-filter", "0,2",
                                    test_rank_path(), "--print-env", "--stderr-lines", "2"},
                                   {{"OMP_NUM_THREADS", "1"}});
  ASSERT_FALSE(r.timed_out) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const EnvByRank env = parse_env(r.out);
  EXPECT_EQ(env.size(), 2u) << r.out;
  EXPECT_EQ(env.count(0) + env.count(2), 2u) << r.out;
  EXPECT_EQ(r.out.find("[rank1]"), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find("[rank1]"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("[rank2]: err"), std::string::npos) << r.err;
}

// torchrun's --log-dir, --redirects and --tee: each rank's streams in
// DIR/<rdzv-id>_<random>/attempt_<n>/<local rank>/{stdout,stderr}.log, as the
// rank wrote them (no prefix), one directory per attempt; redirected streams
// leave the console, teed ones stay on it (here local rank 0's stdout).
TEST(FsdprunOutput, LogDirRedirectsAndTeeAsTorchrun) {
  const PidDir logs;  // a fresh directory, removed however the test ends
  const std::string& dir = logs.path();
  const RunResult r =
      run_launcher({"--nproc-per-node", "2", "--log-dir", dir, "--redirects", "3", "-t", "0:1",
                    "--max-restarts", "1", "--rdzv-id", "logs", test_rank_path(), "--print-env",
                    "--stderr-lines", "2", "--exit-code-if-restart-below", "1:3"},
                   {{"OMP_NUM_THREADS", "1"}});
  ASSERT_FALSE(r.timed_out) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string run = dir + "/logs_";
  const size_t at = r.err.find(run);
  ASSERT_NE(at, std::string::npos) << r.err;
  const std::string run_dir = r.err.substr(at, r.err.find("/attempt_<n>", at) - at);
  const auto read = [](const std::string& path) {
    std::ifstream in(path);
    EXPECT_TRUE(in.good()) << path;
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  // The first attempt failed (each rank exits 3 in it, and the first to do
  // so stops the other): only its files are sure to be there.
  for (int local = 0; local < 2; ++local) {
    for (const char* stream : {"/stdout.log", "/stderr.log"}) {
      read(run_dir + "/attempt_0/" + std::to_string(local) + stream);
    }
  }
  for (int attempt = 1; attempt < 2; ++attempt) {
    for (int local = 0; local < 2; ++local) {
      const std::string rank_dir =
          run_dir + "/attempt_" + std::to_string(attempt) + "/" + std::to_string(local);
      const std::string out = read(rank_dir + "/stdout.log");
      EXPECT_EQ(out.rfind("RANK=" + std::to_string(local) + "\n", 0), 0u) << rank_dir << out;
      EXPECT_NE(out.find("TORCHELASTIC_RESTART_COUNT=" + std::to_string(attempt)),
                std::string::npos)
          << out;
      EXPECT_EQ(read(rank_dir + "/stderr.log"), "err 0 of rank " + std::to_string(local) +
                                                    "\nerr 1 of rank " + std::to_string(local) +
                                                    "\n");
    }
  }
  EXPECT_NE(r.out.find("[rank0]: RANK=0"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[rank1]"), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find("[rank"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace fsdp::launch::testing
