// End-to-end: torchrun's c10d rendezvous in fsdprun (Note [fsdprun's
// rendezvous] in tools/fsdprun/rendezvous.cpp). Several fsdprun "nodes" on
// this host run the same command line; the one that serves the endpoint is
// node 0 and the others get node ranks as they join. Nodes that differ are
// refused with a line naming what differs, and a rendezvous that cannot
// complete ends within its join_timeout, saying why.

#include <gtest/gtest.h>

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "free_port.h"
#include "launch_test_util.h"

namespace fsdp::launch::testing {
namespace {

using namespace std::chrono_literals;

constexpr const char* kToken = "0123456789abcdef0123456789abcdef";

/// One node's fsdprun: `nproc` test ranks printing their environment.
std::vector<std::string> node_args(int port, int nnodes, int nproc, const std::string& extra = "") {
  std::vector<std::string> args = {"--nnodes",         std::to_string(nnodes),
                                   "--nproc-per-node", std::to_string(nproc),
                                   "--rdzv-backend",   "c10d",
                                   "--rdzv-endpoint",  "127.0.0.1:" + std::to_string(port),
                                   "--rdzv-id",        "job7"};
  if (!extra.empty()) args.push_back(extra);
  args.push_back(test_rank_path());
  args.push_back("--print-env");
  return args;
}

/// Waits (at most 10 s) until something listens on 127.0.0.1:`port`.
bool listening(int port) {
  for (auto until = std::chrono::steady_clock::now() + 10s;
       std::chrono::steady_clock::now() < until; std::this_thread::sleep_for(20ms)) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool up = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    if (up) return true;
  }
  return false;
}

std::string describe(const RunResult& r) {
  return "exit " + std::to_string(r.exit_code) + "\nstdout:\n" + r.out + "\nstderr:\n" + r.err;
}

// Three nodes of two ranks: the first (which serves the endpoint) is node 0,
// the others get nodes 1 and 2; every rank of the job appears once, in its
// node's block, with the endpoint as MASTER_ADDR:MASTER_PORT (rank 0's store
// takes the port over) and the job's id.
TEST(FsdprunRendezvous, NodesMeetAndGetRanksInTurn) {
  const int port = fsdp::testing::free_port();
  const std::map<std::string, std::optional<std::string>> env = {{"FSDP_JOB_TOKEN", kToken}};
  std::vector<std::unique_ptr<LauncherProcess>> nodes;
  nodes.push_back(std::make_unique<LauncherProcess>(node_args(port, 3, 2), env));
  ASSERT_TRUE(listening(port));
  for (int k = 0; k < 2; ++k) {
    nodes.push_back(std::make_unique<LauncherProcess>(node_args(port, 3, 2), env));
  }
  std::set<int> ranks;
  for (size_t k = 0; k < nodes.size(); ++k) {
    const RunResult r = nodes[k]->wait(30s);
    ASSERT_FALSE(r.timed_out) << describe(r);
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    const EnvByRank by_rank = parse_env(r.out);
    ASSERT_EQ(by_rank.size(), 2u) << describe(r);
    const int node = by_rank.begin()->first / 2;
    if (k == 0) {
      EXPECT_EQ(node, 0) << describe(r);
      EXPECT_NE(r.err.find("node 0 serves the rendezvous at 127.0.0.1:" + std::to_string(port)),
                std::string::npos)
          << describe(r);
    }
    EXPECT_NE(r.err.find("node rank " + std::to_string(node) + " of 3"), std::string::npos)
        << describe(r);
    for (auto [rank, vars] : by_rank) {
      SCOPED_TRACE("rank " + std::to_string(rank));
      EXPECT_TRUE(ranks.insert(rank).second);
      EXPECT_EQ(vars["GROUP_RANK"], std::to_string(node));
      EXPECT_EQ(vars["GROUP_WORLD_SIZE"], "3");
      EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(rank % 2));
      EXPECT_EQ(vars["WORLD_SIZE"], "6");
      EXPECT_EQ(vars["MASTER_ADDR"], "127.0.0.1");
      EXPECT_EQ(vars["MASTER_PORT"], std::to_string(port));
      EXPECT_EQ(vars["TORCHELASTIC_RUN_ID"], "job7");
    }
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3, 4, 5}));
}

// Nodes with another token or another --rdzv-id are refused, each told why
// (and node 0 logs it); node 0 then gives up at its join_timeout, naming how
// many nodes joined and what to check.
TEST(FsdprunRendezvous, RefusedNodesAndAMissingOneSayWhy) {
  const int port = fsdp::testing::free_port();
  LauncherProcess server(node_args(port, 2, 1, "--rdzv-conf=join_timeout=4"),
                         {{"FSDP_JOB_TOKEN", kToken}});
  ASSERT_TRUE(listening(port));
  // Their own limit (10 s) is past the server's, so that a slow machine fails
  // the test with the server's error, not theirs.
  const RunResult stranger = run_launcher(node_args(port, 2, 1, "--rdzv-conf=join_timeout=10"),
                                          {{"FSDP_JOB_TOKEN", "another-token"}}, 20s);
  EXPECT_EQ(stranger.exit_code, 1) << describe(stranger);
  EXPECT_NE(stranger.err.find("fsdprun: error: node 0 refused this node: its FSDP_JOB_TOKEN "
                              "differs from node 0's: export the same token on every node"),
            std::string::npos)
      << describe(stranger);
  std::vector<std::string> other_job = node_args(port, 2, 1, "--rdzv-conf=join_timeout=10");
  other_job[other_job.size() - 4] = "job8";  // --rdzv-id's value
  const RunResult other = run_launcher(other_job, {{"FSDP_JOB_TOKEN", kToken}}, 20s);
  EXPECT_EQ(other.exit_code, 1) << describe(other);
  EXPECT_NE(other.err.find("its --rdzv-id 'job8' differs from node 0's 'job7'"), std::string::npos)
      << describe(other);
  const RunResult r = server.wait(20s);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("refused the node from 127.0.0.1: its FSDP_JOB_TOKEN differs"),
            std::string::npos)
      << describe(r);
  EXPECT_NE(r.err.find("fsdprun: error: the rendezvous at 127.0.0.1:" + std::to_string(port) +
                       " timed out after 4 s: 1 of 2 nodes have joined"),
            std::string::npos)
      << describe(r);
  EXPECT_TRUE(parse_env(r.out).empty()) << "no rank may start: " << describe(r);
}

// One node too many: the job forms with the first two, and the third is
// refused (it came in the same turn), or finds the port let go: on this host
// it then serves a rendezvous of its own, which times out (rank 0's store,
// which would hold the port in a real job, is absent here); on another it
// finds nothing, or rank 0's store, which closes the connection. It ends
// within its join_timeout, saying so, and starts no rank.
TEST(FsdprunRendezvous, OneNodeTooManyIsTurnedAway) {
  const int port = fsdp::testing::free_port();
  const std::map<std::string, std::optional<std::string>> env = {{"FSDP_JOB_TOKEN", kToken}};
  LauncherProcess server(node_args(port, 2, 1), env);
  ASSERT_TRUE(listening(port));
  LauncherProcess a(node_args(port, 2, 1, "--rdzv-conf=join_timeout=3"), env);
  LauncherProcess b(node_args(port, 2, 1, "--rdzv-conf=join_timeout=3"), env);
  const RunResult r = server.wait(20s);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(parse_env(r.out).size(), 1u) << describe(r);
  int joined = 0;
  for (LauncherProcess* node : {&a, &b}) {
    const RunResult n = node->wait(20s);
    ASSERT_FALSE(n.timed_out) << describe(n);
    if (n.exit_code == 0) {
      ++joined;
      EXPECT_NE(n.err.find("node rank 1 of 2"), std::string::npos) << describe(n);
      continue;
    }
    EXPECT_EQ(n.exit_code, 1) << describe(n);
    const bool said_why = n.err.find("this one is too many") != std::string::npos ||
                          n.err.find("no rendezvous at") != std::string::npos ||
                          n.err.find("without a node rank") != std::string::npos ||
                          n.err.find("timed out after 3 s: 1 of 2") != std::string::npos;
    EXPECT_TRUE(said_why) << describe(n);
    EXPECT_TRUE(parse_env(n.out).empty()) << describe(n);
  }
  EXPECT_EQ(joined, 1);
}

// torchrun's --local-addr: node 0 announces it as MASTER_ADDR, where
// fsdprun would otherwise announce the endpoint's host.
TEST(FsdprunRendezvous, NodeZerosLocalAddrIsMasterAddr) {
  const int port = fsdp::testing::free_port();
  const std::map<std::string, std::optional<std::string>> env = {{"FSDP_JOB_TOKEN", kToken}};
  const std::vector<std::string> args = node_args(port, 2, 1, "--local-addr=127.0.0.2");
  LauncherProcess first(args, env);
  ASSERT_TRUE(listening(port));
  LauncherProcess second(args, env);
  for (LauncherProcess* node : {&first, &second}) {
    const RunResult r = node->wait(30s);
    ASSERT_FALSE(r.timed_out) << describe(r);
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    for (const auto& [rank, vars] : parse_env(r.out)) {
      EXPECT_EQ(vars.at("MASTER_ADDR"), "127.0.0.2") << "rank " << rank;
    }
    EXPECT_EQ(parse_env(r.out).size(), 1u) << describe(r);
  }
}

// --max-restarts with the c10d rendezvous: every rank fails its first
// attempt, both nodes restart and meet again (node 0 serving anew once its
// ranks are gone), and the second attempt runs every rank of the job.
TEST(FsdprunRendezvous, NodesMeetAgainAtEachRestart) {
  const int port = fsdp::testing::free_port();
  const std::map<std::string, std::optional<std::string>> env = {{"FSDP_JOB_TOKEN", kToken}};
  std::vector<std::string> args = node_args(port, 2, 2, "--max-restarts=1");
  args.insert(args.end(), {"--exit-code-if-restart-below", "1:3"});
  LauncherProcess first(args, env);
  ASSERT_TRUE(listening(port));
  LauncherProcess second(args, env);
  std::set<int> ranks;
  for (LauncherProcess* node : {&first, &second}) {
    const RunResult r = node->wait(30s);
    ASSERT_FALSE(r.timed_out) << describe(r);
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_NE(r.err.find("restarting all ranks (restart 1/1)"), std::string::npos) << describe(r);
    EXPECT_EQ(count_occurrences(r.err, "fsdprun: node rank "), 2) << describe(r);
    for (const auto& [rank, vars] : parse_env(r.out)) {
      if (vars.at("TORCHELASTIC_RESTART_COUNT") == "1") ranks.insert(rank);
    }
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3}));
}

// torchrun's elastic --nnodes MIN:MAX: once MIN nodes have joined, node 0
// waits last_call_timeout for more, and the job is those that came: two of
// 2:3 (both nodes told so, the ranks' world 2 x 2), or node 0 alone of 1:2,
// which still meets again at its restart (a lost node's replacement could
// join there).
TEST(FsdprunRendezvous, AnElasticNodeCountIsTheNodesThatJoined) {
  const std::map<std::string, std::optional<std::string>> env = {{"FSDP_JOB_TOKEN", kToken}};
  const auto elastic = [](int port, const char* nnodes, const char* last_call) {
    std::vector<std::string> args = node_args(port, 1, 2, last_call);
    args[1] = nnodes;  // --nnodes' value
    return args;
  };
  int port = fsdp::testing::free_port();
  LauncherProcess first(elastic(port, "2:3", "--rdzv-conf=last_call_timeout=1"), env);
  ASSERT_TRUE(listening(port));
  LauncherProcess second(elastic(port, "2:3", "--rdzv-conf=last_call_timeout=1"), env);
  for (LauncherProcess* node : {&first, &second}) {
    const RunResult r = node->wait(30s);
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_NE(r.err.find(" of 2\n"), std::string::npos) << describe(r);
    for (auto [rank, vars] : parse_env(r.out)) EXPECT_EQ(vars["WORLD_SIZE"], "4") << describe(r);
  }
  port = fsdp::testing::free_port();
  std::vector<std::string> args = elastic(port, "1:2", "--rdzv-conf=last_call_timeout=0.5");
  args.insert(args.begin(), "--max-restarts=1");
  args.insert(args.end(), {"--exit-code-if-restart-below", "1:3"});
  const RunResult alone = run_launcher(args, env, 20s);
  ASSERT_EQ(alone.exit_code, 0) << describe(alone);
  EXPECT_EQ(count_occurrences(alone.err, "fsdprun: node rank 0 of 1"), 2) << describe(alone);
  const EnvByRank ranks = parse_env(alone.out);
  ASSERT_EQ(ranks.size(), 2u) << describe(alone);
  for (auto [rank, vars] : ranks) EXPECT_EQ(vars["WORLD_SIZE"], "2");
}

// The endpoint's port held by something else: bound and not listening (no
// node can serve, none answers: the join_timeout ends it), or a program that
// closes what it accepts (an error at once).
TEST(FsdprunRendezvous, APortHeldByAnotherProgramEndsWithAReason) {
  // Held without SO_REUSEADDR (so that no store can bind it too), which a
  // port free_port() found free with it refuses while an earlier connection
  // of it is in TIME_WAIT (a `ctest -j` run failed so): another port then.
  int port = 0;
  int held = -1;
  for (int attempt = 0; attempt < 20 && held < 0; ++attempt) {
    port = fsdp::testing::free_port();
    held = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (::bind(held, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      ::close(held);
      held = -1;
    }
  }
  ASSERT_GE(held, 0) << "no port could be held";
  RunResult r = run_launcher(node_args(port, 2, 1, "--rdzv-conf=join_timeout=2"),
                             {{"FSDP_JOB_TOKEN", kToken}}, 20s);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("no rendezvous at 127.0.0.1:" + std::to_string(port) + " after 2 s"),
            std::string::npos)
      << describe(r);

  ASSERT_EQ(::listen(held, 8), 0);
  std::atomic<bool> stop{false};
  std::thread closer([&] {
    while (!stop) {
      pollfd pfd{held, POLLIN, 0};
      if (::poll(&pfd, 1, 50) > 0) ::close(::accept(held, nullptr, nullptr));
    }
  });
  r = run_launcher(node_args(port, 2, 1, "--rdzv-conf=join_timeout=2"),
                   {{"FSDP_JOB_TOKEN", kToken}}, 20s);
  stop = true;
  closer.join();
  ::close(held);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  // Closed unanswered is tried again (a restarted job's old store), until
  // the limit.
  EXPECT_NE(r.err.find("closed the connection without a node rank for 2 s"), std::string::npos)
      << describe(r);
}

}  // namespace
}  // namespace fsdp::launch::testing
