// In-process tests of fsdprun's pure pieces: option parsing, the line
// prefixer, the rank environment and exit-status descriptions.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <string>
#include <vector>

#include "exit_status.h"
#include "line_prefixer.h"
#include "options.h"
#include "rank_env.h"

namespace fsdp::launch {
namespace {

TEST(FsdprunOptions, DefaultsForSingleNode) {
  const ParseResult r = parse_options({"prog"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.nproc_per_node, 1);
  EXPECT_EQ(r.options.nnodes, 1);
  EXPECT_EQ(r.options.node_rank, 0);
  EXPECT_EQ(r.options.master_addr, "127.0.0.1");
  EXPECT_FALSE(r.options.master_port.has_value());  // A free port is chosen.
  EXPECT_EQ(r.options.max_restarts, 0);
  EXPECT_DOUBLE_EQ(r.options.kill_timeout_s, 10.0);
  EXPECT_TRUE(r.options.prefix_output);
  EXPECT_EQ(r.options.command, std::vector<std::string>{"prog"});
}

TEST(FsdprunOptions, MultiNodeDefaultsToPort29500) {
  const ParseResult r = parse_options({"--nnodes", "2", "--node-rank", "1", "prog"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.master_port, 29500);
}

TEST(FsdprunOptions, UnderscoreAndEqualsSpellings) {
  const ParseResult r = parse_options(
      {"--nproc_per_node=4", "--nnodes=3", "--node_rank", "2", "--master_addr=10.0.0.1",
       "--master_port", "1234", "--max_restarts=5", "--kill_timeout=0.5", "--no_prefix", "prog"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.nproc_per_node, 4);
  EXPECT_EQ(r.options.nnodes, 3);
  EXPECT_EQ(r.options.node_rank, 2);
  EXPECT_EQ(r.options.master_addr, "10.0.0.1");
  EXPECT_EQ(r.options.master_port, 1234);
  EXPECT_EQ(r.options.max_restarts, 5);
  EXPECT_DOUBLE_EQ(r.options.kill_timeout_s, 0.5);
  EXPECT_FALSE(r.options.prefix_output);
}

TEST(FsdprunOptions, StopsAtProgramOrDoubleDash) {
  ParseResult r = parse_options({"--nproc-per-node", "2", "./train", "--lr", "3", "--nnodes", "9"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.nnodes, 1);
  EXPECT_EQ(r.options.command, (std::vector<std::string>{"./train", "--lr", "3", "--nnodes", "9"}));

  r = parse_options({"--", "--weird-name", "-x"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.command, (std::vector<std::string>{"--weird-name", "-x"}));
}

TEST(FsdprunOptions, Help) {
  EXPECT_EQ(parse_options({"--help"}).kind, ParseResult::Kind::kHelp);
  EXPECT_EQ(parse_options({"-h"}).kind, ParseResult::Kind::kHelp);
}

/// Expects `args` to be rejected with an error containing every `needle`.
void expect_error(const std::vector<std::string>& args, const std::vector<std::string>& needles) {
  const ParseResult r = parse_options(args);
  ASSERT_EQ(r.kind, ParseResult::Kind::kError);
  for (const std::string& needle : needles) {
    EXPECT_NE(r.error.find(needle), std::string::npos)
        << "error '" << r.error << "' lacks '" << needle << "'";
  }
}

TEST(FsdprunOptions, RejectsBadValues) {
  expect_error({"--nproc-per-node", "0", "p"}, {"--nproc-per-node", "'0'"});
  expect_error({"--nproc-per-node", "2x", "p"}, {"--nproc-per-node", "'2x'"});
  expect_error({"--nproc-per-node", "", "p"}, {"--nproc-per-node"});
  expect_error({"--nnodes", "0", "p"}, {"--nnodes", "'0'"});
  expect_error({"--nnodes", "1:2", "p"}, {"--nnodes", "'1:2'"});
  expect_error({"--node-rank", "-1", "p"}, {"--node-rank", "'-1'"});
  expect_error({"--node-rank", "2", "--nnodes", "2", "p"}, {"--node-rank", "'2'"});
  expect_error({"--master-port", "0", "p"}, {"--master-port", "'0'"});
  expect_error({"--master-port", "65536", "p"}, {"--master-port", "'65536'"});
  expect_error({"--master-addr=", "p"}, {"--master-addr"});
  expect_error({"--max-restarts", "-1", "p"}, {"--max-restarts", "'-1'"});
  expect_error({"--kill-timeout", "soon", "p"}, {"--kill-timeout", "'soon'"});
  expect_error({"--kill-timeout", "-1", "p"}, {"--kill-timeout", "'-1'"});
  expect_error({"--nproc-per-node"}, {"--nproc-per-node", "missing value"});
  expect_error({"--no-prefix=yes", "p"}, {"--no-prefix"});
  expect_error({"--frobnicate", "p"}, {"unknown flag", "--frobnicate"});
  expect_error({"--nproc-per-node", "2"}, {"missing the program"});
  expect_error({}, {"missing the program"});
}

TEST(FsdprunOptions, StandaloneIsSingleNode) {
  ParseResult r = parse_options({"--standalone", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_TRUE(r.options.standalone);
  EXPECT_EQ(r.options.master_addr, "127.0.0.1");
  EXPECT_FALSE(r.options.master_port.has_value());
  expect_error({"--standalone", "--nnodes", "2", "p"}, {"--standalone"});
  expect_error({"--standalone", "--master-port", "1234", "p"}, {"--standalone"});
}

TEST(FsdprunOptions, UsageMentionsEveryFlag) {
  const std::string usage = usage_text();
  for (const char* flag :
       {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
        "--standalone", "--max-restarts", "--kill-timeout", "--no-prefix", "--help"}) {
    EXPECT_NE(usage.find(flag), std::string::npos) << flag;
  }
}

TEST(FsdprunLinePrefixer, PrefixesCompleteLinesOnly) {
  LinePrefixer prefixer("[rank2]: ");
  std::string out;
  prefixer.feed("hel", &out);
  EXPECT_EQ(out, "");
  prefixer.feed("lo\nwor", &out);
  EXPECT_EQ(out, "[rank2]: hello\n");
  out.clear();
  prefixer.feed("ld\n\nx\n", &out);
  EXPECT_EQ(out, "[rank2]: world\n[rank2]: \n[rank2]: x\n");
  out.clear();
  prefixer.feed("tail", &out);
  prefixer.finish(&out);
  EXPECT_EQ(out, "[rank2]: tail\n");
  out.clear();
  prefixer.finish(&out);  // Nothing pending: nothing emitted.
  EXPECT_EQ(out, "");
}

TEST(FsdprunLinePrefixer, EmptyPrefixPassesLinesThrough) {
  LinePrefixer prefixer("");
  std::string out;
  prefixer.feed("a\nb", &out);
  prefixer.finish(&out);
  EXPECT_EQ(out, "a\nb\n");
}

TEST(FsdprunLinePrefixer, OverlongLineIsReleasedInPieces) {
  LinePrefixer prefixer("> ");
  std::string out;
  const std::string chunk(LinePrefixer::kMaxLineBytes / 4, 'y');
  for (int i = 0; i < 5; ++i) prefixer.feed(chunk, &out);
  EXPECT_EQ(out, "> " + std::string(LinePrefixer::kMaxLineBytes, 'y') + "\n");
  EXPECT_EQ(prefixer.pending_bytes(), chunk.size());
}

/// The value of `key` in a "KEY=VALUE" list, or "<unset>".
std::string env_value(const std::vector<std::string>& env, const std::string& key) {
  for (const std::string& entry : env) {
    if (entry.rfind(key + "=", 0) == 0) return entry.substr(key.size() + 1);
  }
  return "<unset>";
}

TEST(FsdprunRankEnv, SetsTorchrunVariables) {
  LaunchOptions options;
  options.nproc_per_node = 3;
  options.nnodes = 2;
  options.node_rank = 1;
  options.master_addr = "10.1.2.3";
  options.max_restarts = 4;
  const std::vector<std::string> base = {"PATH=/bin", "RANK=99", "HOME=/h"};
  const auto env = build_rank_environment(options, 2222, 2, 1, base);
  EXPECT_EQ(env_value(env, "RANK"), "5");
  EXPECT_EQ(env_value(env, "LOCAL_RANK"), "2");
  EXPECT_EQ(env_value(env, "WORLD_SIZE"), "6");
  EXPECT_EQ(env_value(env, "LOCAL_WORLD_SIZE"), "3");
  EXPECT_EQ(env_value(env, "GROUP_RANK"), "1");
  EXPECT_EQ(env_value(env, "ROLE_RANK"), "5");
  EXPECT_EQ(env_value(env, "ROLE_WORLD_SIZE"), "6");
  EXPECT_EQ(env_value(env, "MASTER_ADDR"), "10.1.2.3");
  EXPECT_EQ(env_value(env, "MASTER_PORT"), "2222");
  EXPECT_EQ(env_value(env, "TORCHELASTIC_RESTART_COUNT"), "1");
  EXPECT_EQ(env_value(env, "TORCHELASTIC_MAX_RESTARTS"), "4");
  EXPECT_EQ(env_value(env, "OMP_NUM_THREADS"), "1");
  EXPECT_EQ(env_value(env, "PATH"), "/bin");
  EXPECT_EQ(std::count_if(env.begin(), env.end(),
                          [](const std::string& e) { return e.rfind("RANK=", 0) == 0; }),
            1);
}

TEST(FsdprunRankEnv, KeepsUserOmpNumThreadsAndSingleRank) {
  LaunchOptions options;
  options.nproc_per_node = 2;
  EXPECT_FALSE(defaults_omp_num_threads(options, {"OMP_NUM_THREADS=8"}));
  EXPECT_EQ(
      env_value(build_rank_environment(options, 1, 0, 0, {"OMP_NUM_THREADS=8"}), "OMP_NUM_THREADS"),
      "8");
  options.nproc_per_node = 1;
  EXPECT_FALSE(defaults_omp_num_threads(options, {}));
  EXPECT_EQ(env_value(build_rank_environment(options, 1, 0, 0, {}), "OMP_NUM_THREADS"), "<unset>");
}

TEST(FsdprunExitStatus, DescribesExitsAndSignals) {
  const int exited3 = 3 << 8;  // What waitpid reports for exit(3).
  EXPECT_EQ(describe_wait_status(exited3), "exited with status 3");
  EXPECT_EQ(exit_code_for(exited3), 3);
  EXPECT_FALSE(is_success(exited3));
  EXPECT_TRUE(is_success(0));
  const int killed = SIGKILL;  // Terminated by SIGKILL, no core.
  ASSERT_TRUE(WIFSIGNALED(killed));
  EXPECT_EQ(describe_wait_status(killed), "was killed by signal 9 (SIGKILL)");
  EXPECT_EQ(exit_code_for(killed), 128 + SIGKILL);
  EXPECT_EQ(signal_name(SIGTERM), "SIGTERM");
}

}  // namespace
}  // namespace fsdp::launch
