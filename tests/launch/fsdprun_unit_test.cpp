// In-process tests of fsdprun's pure pieces: option parsing, the line
// prefixer, the rank environment and exit-status descriptions.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <string>
#include <vector>

#include "detail/posix_socket.h"
#include "device_count.h"
#include "exit_status.h"
#include "line_prefixer.h"
#include "options.h"
#include "rank_env.h"
#include "rendezvous.h"

namespace fsdp::launch {
namespace {

/// The value of `key` in a "KEY=VALUE" list, or "<unset>".
std::string env_value(const std::vector<std::string>& env, const std::string& key) {
  for (const std::string& entry : env) {
    if (entry.rfind(key + "=", 0) == 0) return entry.substr(key.size() + 1);
  }
  return "<unset>";
}

// torchrun's help asks for IPv6 addresses in brackets and hands the ranks
// the address without them.
TEST(FsdprunOptions, BracketedIpv6MasterAddrReachesTheRanksWithoutBrackets) {
  const ParseResult r = parse_options({"--master-addr", "[::1]", "prog"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.master_addr, "::1");
  EXPECT_EQ(parse_options({"--master-addr", "::1", "prog"}).options.master_addr, "::1");
  // --local-addr too: it becomes the other nodes' MASTER_ADDR.
  EXPECT_EQ(parse_options({"--local-addr", "[::1]", "prog"}).options.local_addr, "::1");
}

TEST(FsdprunOptions, DefaultsForSingleNode) {
  const ParseResult r = parse_options({"prog"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.nproc_per_node, 1);
  EXPECT_EQ(r.options.nnodes, 1);
  EXPECT_EQ(r.options.node_rank, 0);
  EXPECT_EQ(r.options.master_addr, "127.0.0.1");
  EXPECT_FALSE(r.options.master_port.has_value());  // A free port is chosen.
  EXPECT_EQ(r.options.max_restarts, 0);
  EXPECT_DOUBLE_EQ(r.options.kill_timeout_s, 30.0);  // torchrun's shutdown timeout
  EXPECT_EQ(r.options.signals_to_handle, (std::vector<int>{SIGTERM, SIGINT, SIGHUP, SIGQUIT}));
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
  expect_error({"--nnodes", "1:2", "p"}, {"--nnodes 1:2", "needs --rdzv-backend c10d"});
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
  // Where the ranks meet and under which id, --standalone decides, saying
  // what it ignores (torchrun ignores them silently).
  r = parse_options({"--standalone", "--master-addr", "10.0.0.1", "--master-port", "1234",
                     "--rdzv-endpoint", "h:5", "--rdzv-id", "7", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.master_addr, "127.0.0.1");
  EXPECT_FALSE(r.options.master_port.has_value());
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_EQ(r.warnings[0],
            "--standalone ignores --master-addr, --master-port, --rdzv-endpoint, --rdzv-id: the "
            "ranks meet at 127.0.0.1 on a free port, under a random TORCHELASTIC_RUN_ID (as "
            "torchrun's)");
}

TEST(FsdprunOptions, UsageMentionsEveryFlag) {
  const std::string usage = usage_text();
  ASSERT_GE(flag_names().size(), 17u);
  for (const std::string& flag : flag_names()) {
    EXPECT_NE(usage.find(flag), std::string::npos) << flag;
  }
}

// "Contains" for the warnings and errors below.
bool mentions(const std::vector<std::string>& lines, const std::string& text) {
  return std::any_of(lines.begin(), lines.end(),
                     [&](const std::string& l) { return l.find(text) != std::string::npos; });
}

// torchrun's multi-node command line, the same on every node: the c10d
// rendezvous at the endpoint assigns the node ranks (--node-rank ignored,
// with a warning, as torchrun ignores it), and rank 0's store takes over the
// endpoint's port.
TEST(FsdprunOptions, TorchrunsC10dRendezvous) {
  ParseResult r =
      parse_options({"--nnodes=2", "--nproc-per-node=8", "--rdzv-id=100", "--rdzv-backend=c10d",
                     "--rdzv-endpoint=node01:29401", "--node-rank", "1", "--no-python", "prog"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_TRUE(r.options.assigns_node_ranks());
  EXPECT_EQ(r.options.rdzv_host, "node01");
  EXPECT_EQ(r.options.rdzv_port, 29401);
  EXPECT_EQ(r.options.rdzv_id, "100");
  EXPECT_EQ(r.options.master_addr, "node01");
  EXPECT_EQ(r.options.master_port, 29401);
  EXPECT_EQ(r.options.node_rank, 0);
  EXPECT_DOUBLE_EQ(r.options.join_timeout_s, 600.0);
  EXPECT_TRUE(mentions(r.warnings, "--node-rank is ignored")) << r.warnings.size();
  EXPECT_EQ(r.options.command, std::vector<std::string>{"prog"});

  // torchrun's defaults: port 29400, host localhost.
  r = parse_options({"--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "node01", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.rdzv_port, 29400);
  EXPECT_TRUE(r.warnings.empty());
  r = parse_options({"--nnodes", "2", "--rdzv-backend", "c10d", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.rdzv_host, "localhost");
  EXPECT_EQ(r.options.rdzv_port, 29400);
  EXPECT_TRUE(mentions(r.warnings, "reaches no other host"));

  // IPv6, and one node: the endpoint is simply rank 0's (port 0: a free one).
  r = parse_options({"--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1]:1234", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_FALSE(r.options.assigns_node_ranks());
  EXPECT_EQ(r.options.master_addr, "::1");
  EXPECT_EQ(r.options.master_port, 1234);
  r = parse_options({"--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_FALSE(r.options.master_port.has_value());

  // join_timeout and is_host are read; the store's other settings are
  // ignored, saying so. torchrun's --nnodes N:N is N.
  r = parse_options({"--nnodes", "2:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:5",
                     "--rdzv-conf", "join_timeout=5,read_timeout=3,is_host=true", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.nnodes, 2);
  EXPECT_EQ(r.options.min_nnodes, 0);
  EXPECT_DOUBLE_EQ(r.options.join_timeout_s, 5.0);
  EXPECT_EQ(r.options.rdzv_is_host, true);
  EXPECT_TRUE(mentions(r.warnings, "'read_timeout' is ignored"));
  EXPECT_FALSE(parse_options({"p"}).options.rdzv_is_host.has_value());

  // torchrun's elastic --nnodes MIN:MAX, with last_call_timeout.
  r = parse_options({"--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:5",
                     "--rdzv-conf", "last_call_timeout=2.5", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.nnodes, 4);
  EXPECT_EQ(r.options.min_nnodes, 1);
  EXPECT_TRUE(r.options.assigns_node_ranks());
  EXPECT_DOUBLE_EQ(r.options.last_call_timeout_s, 2.5);

  // --master-addr with c10d: ignored, as torchrun.
  r = parse_options(
      {"--rdzv-backend", "c10d", "--rdzv-endpoint", "h:5", "--master-addr", "x", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.master_addr, "h");
  EXPECT_TRUE(mentions(r.warnings, "--master-addr and --master-port are ignored"));
}

// The static backend (the default) meets at --rdzv-endpoint when given, as
// at --master-addr:--master-port.
TEST(FsdprunOptions, StaticRendezvousAtTheEndpoint) {
  ParseResult r =
      parse_options({"--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:1234", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_FALSE(r.options.assigns_node_ranks());
  EXPECT_EQ(r.options.node_rank, 1);
  EXPECT_EQ(r.options.master_addr, "10.0.0.1");
  EXPECT_EQ(r.options.master_port, 1234);
  r = parse_options({"--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.master_port, 29500);
}

// The rest of torchrun's flags: --role sets ROLE_NAME; --monitor-interval
// and --start-method are accepted (the latter with a warning) and change
// nothing.
TEST(FsdprunOptions, TorchrunsOtherFlags) {
  ParseResult r = parse_options(
      {"--role", "trainer", "--monitor-interval=0.1", "--start-method", "spawn", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.role, "trainer");
  EXPECT_TRUE(mentions(r.warnings, "--start-method spawn is ignored"));
  EXPECT_EQ(env_value(build_rank_environment(r.options, 1, 0, 0, {}), "ROLE_NAME"), "trainer");
  EXPECT_EQ(parse_options({"--monitor-interval", "x", "p"}).kind, ParseResult::Kind::kError);
}

// torchrun's --log-dir, --redirects (-r) and --tee (-t): one value for
// every local rank, or local rank by local rank.
TEST(FsdprunOptions, LogDirRedirectsAndTee) {
  ParseResult r = parse_options({"--log-dir", "/l", "-r", "3", "--tee=0:1,2:2", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.log_dir, "/l");
  EXPECT_EQ(r.options.redirects.of(5), 3);
  EXPECT_EQ(r.options.tee.of(0), 1);
  EXPECT_EQ(r.options.tee.of(1), 0);
  EXPECT_EQ(r.options.tee.of(2), 2);
  EXPECT_TRUE(r.options.tee.any());
  EXPECT_FALSE(parse_options({"p"}).options.redirects.any());
  EXPECT_FALSE(parse_options({"-r", "0:0", "p"}).options.redirects.any());
  for (const char* bad : {"4", "x", "0:4", "a:1", "0:1,", ":1", ""}) {
    const ParseResult e = parse_options({"--redirects", bad, "p"});
    EXPECT_EQ(e.kind, ParseResult::Kind::kError) << bad;
    EXPECT_NE(e.error.find("per local rank: 0:3,1:2"), std::string::npos) << e.error;
  }
}

TEST(FsdprunOptions, BadRendezvousFlagsNameTheFix) {
  const auto error_of = [](const std::vector<std::string>& args) {
    const ParseResult r = parse_options(args);
    EXPECT_EQ(r.kind, ParseResult::Kind::kError);
    return r.error;
  };
  EXPECT_NE(error_of({"--rdzv-backend", "etcd", "p"}).find("use c10d"), std::string::npos);
  EXPECT_NE(error_of({"--rdzv-backend", "zmq", "p"}).find("must be static or c10d"),
            std::string::npos);
  for (const char* bad : {":12", "h:70000", "h:x", "[::1", "[::1]x"}) {
    EXPECT_NE(error_of({"--rdzv-endpoint", bad, "p"}).find("expected HOST"), std::string::npos)
        << bad;
  }
  EXPECT_NE(error_of({"--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:0", "p"})
                .find("needs a port every node knows"),
            std::string::npos);
  EXPECT_NE(error_of({"--rdzv-conf", "join_timeout=0", "p"}).find("join_timeout"),
            std::string::npos);
  EXPECT_NE(error_of({"--rdzv-conf", "is_host=maybe", "p"}).find("is_host must be 1 or 0"),
            std::string::npos);
  EXPECT_NE(error_of({"--nnodes", "1:4", "p"}).find("needs --rdzv-backend c10d"),
            std::string::npos);
  for (const char* bad : {"4:1", "0:2", "1:", ":2", "1:2:3"}) {
    EXPECT_NE(error_of({"--nnodes", bad, "p"}).find("MIN:MAX with 1 <= MIN <= MAX"),
              std::string::npos)
        << bad;
  }
  EXPECT_NE(error_of({"--rdzv-id", "", "p"}).find("non-empty"), std::string::npos);
  EXPECT_NE(error_of({"--nproc-per-node", "gpus", "p"}).find("gpu, cpu or auto"),
            std::string::npos);
  for (const char* bad : {"", "a", "0,,1", "-1"}) {
    EXPECT_NE(error_of({"--local-ranks-filter", bad, "p"}).find("expected local ranks"),
              std::string::npos)
        << bad;
  }
}

// torchrun's --nproc-per-node gpu, cpu and auto, counted by visible_cuda_gpus
// and usable_cpus (here, a machine of 4 GPUs and 16 CPUs, or none), and
// --local-ranks-filter ranks the node has not (ignored with a note, as
// torchrun ignores them).
TEST(FsdprunOptions, NprocPerNodeByDevice) {
  std::vector<std::string> notes;
  std::string error;
  const auto resolved = [&](const std::string& device, int gpus, std::vector<int> filter = {}) {
    ParseResult r = parse_options({"--nproc-per-node", device, "p"});
    EXPECT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
    r.options.local_ranks_filter = std::move(filter);
    const auto count = [gpus](std::string* why) {
      if (gpus == 0) *why = "no CUDA driver";
      return gpus;
    };
    return resolve_nproc_per_node(&r.options, count, 16, &notes, &error) ? r.options.nproc_per_node
                                                                         : -1;
  };
  using Lines = std::vector<std::string>;
  EXPECT_EQ(resolved("gpu", 4), 4);
  EXPECT_EQ(notes, Lines{"--nproc-per-node gpu: 4 ranks, one per visible CUDA GPU"});
  EXPECT_EQ(resolved("auto", 4), 4);
  EXPECT_EQ(resolved("auto", 1), 1);
  EXPECT_EQ(notes, Lines{"--nproc-per-node auto: 1 rank, one per visible CUDA GPU"});
  EXPECT_EQ(resolved("auto", 0), 16);
  EXPECT_EQ(notes, Lines{"--nproc-per-node auto: 16 ranks, one per usable CPU"});
  EXPECT_EQ(resolved("cpu", 4), 16);
  EXPECT_EQ(resolved("3", 4), 3);
  EXPECT_TRUE(notes.empty());
  EXPECT_EQ(resolved("gpu", 0), -1);
  EXPECT_EQ(error,
            "--nproc-per-node gpu: no CUDA GPU is visible (no CUDA driver); give a number of ranks "
            "instead");
  EXPECT_EQ(resolved("gpu", 4, {0, 3}), 4);
  EXPECT_EQ(notes.size(), 1u);
  EXPECT_EQ(resolved("gpu", 2, {0, 3}), 2);
  EXPECT_EQ(notes.back(), "--local-ranks-filter: this node has no local rank 3 (2 ranks)");
  EXPECT_GE(usable_cpus(), 1);
}

// An IPv4 or IPv6 address in a sockaddr_storage.
sockaddr_storage address(const char* text) {
  sockaddr_storage s{};
  auto& a4 = reinterpret_cast<sockaddr_in&>(s);
  auto& a6 = reinterpret_cast<sockaddr_in6&>(s);
  if (::inet_pton(AF_INET, text, &a4.sin_addr) == 1) {
    a4.sin_family = AF_INET;
  } else {
    EXPECT_EQ(::inet_pton(AF_INET6, text, &a6.sin6_addr), 1) << text;
    a6.sin6_family = AF_INET6;
  }
  return s;
}

// Node 0's MASTER_ADDR after the c10d rendezvous (Note [fsdprun's
// rendezvous]): the endpoint's host, unless it is a loopback address on node 0
// while the nodes came from other hosts (Debian's /etc/hosts maps a host's own
// name to 127.0.1.1, and the store listens on MASTER_ADDR alone): then the
// address node 1 reached, as an IPv4 address where it came over IPv4.
TEST(FsdprunRendezvousAddress, ALoopbackHostMeetsWhereTheOthersReachedNodeZero) {
  const auto meet = [](const char* host, std::vector<sockaddr_storage> endpoint, bool here,
                       const char* peer, const char* reached) {
    return meeting_address(host, endpoint, here, address(peer), address(reached));
  };
  EXPECT_EQ(meet("node0", {address("127.0.1.1")}, true, "10.0.0.2", "10.0.0.1"), "10.0.0.1");
  EXPECT_EQ(meet("node0", {address("127.0.1.1")}, true, "::ffff:10.0.0.2", "::ffff:10.0.0.1"),
            "10.0.0.1");
  EXPECT_EQ(meet("node0", {address("fd00::1")}, true, "fd00::2", "fd00::1"), "node0");
  EXPECT_EQ(meet("node0", {address("10.0.0.1")}, true, "10.0.0.2", "10.0.0.1"), "node0");
  // is_host=1 behind a virtual IP none of node 0's: where the node reached it.
  EXPECT_EQ(meet("vip", {address("10.9.9.9")}, false, "10.0.0.2", "10.0.0.1"), "10.0.0.1");
  // Every "node" on one host (the tests): the host stays.
  EXPECT_EQ(meet("localhost", {address("127.0.0.1"), address("::1")}, true, "::ffff:127.0.0.1",
                 "::ffff:127.0.0.1"),
            "localhost");
  for (const char* loopback : {"127.0.0.1", "127.0.1.1", "::1", "::ffff:127.0.0.5"}) {
    EXPECT_TRUE(detail::is_loopback(address(loopback))) << loopback;
    EXPECT_TRUE(detail::is_loopback_host(loopback)) << loopback;
  }
  for (const char* other : {"10.0.0.1", "::ffff:10.0.0.1", "fd00::1", "128.0.0.1"}) {
    EXPECT_FALSE(detail::is_loopback(address(other))) << other;
    EXPECT_FALSE(detail::is_loopback_host(other)) << other;
  }
  // libfsdp asks the same of MASTER_ADDR as written; a name is no address.
  EXPECT_TRUE(detail::is_loopback_host("localhost"));
  EXPECT_FALSE(detail::is_loopback_host("node0"));
  EXPECT_EQ(peer_name(address("::ffff:192.168.1.7")), "192.168.1.7");
  EXPECT_EQ(peer_name(address("fd00::7")), "fd00::7");
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

// A progress bar redraws its line after '\r': each redraw is released at
// once, prefixed, not held until the bar's last '\n' (a review found such
// bars invisible under fsdprun); "\r\n" stays one ending.
TEST(FsdprunLinePrefixer, CarriageReturnsEndLinesAsTheyCome) {
  LinePrefixer prefixer("[rank0]: ");
  std::string out;
  prefixer.feed(" 10%\r 20%", &out);
  EXPECT_EQ(out, "[rank0]:  10%\r");
  out.clear();
  prefixer.feed("\r100%\ndone\r\nnext\n", &out);
  EXPECT_EQ(out, "[rank0]:  20%\r[rank0]: 100%\n[rank0]: done\r\n[rank0]: next\n");
  out.clear();
  prefixer.feed("split\r", &out);  // a "\r\n" across two reads
  prefixer.feed("\nafter\n", &out);
  EXPECT_EQ(out, "[rank0]: split\r\n[rank0]: after\n");
}

// A rank quiet in mid-line (a prompt, dots of progress) has its partial line
// shown with the prefix (it waited for the line's end, which may never come
// while the rank waits for input); the rest of the line follows without one,
// and the end of the stream ends the line.
TEST(FsdprunLinePrefixer, APartialLineShownWhenQuietIsContinuedWithoutAPrefix) {
  LinePrefixer prefixer("[rank0]: ");
  std::string out;
  prefixer.feed("Password: ", &out);
  EXPECT_EQ(out, "");
  prefixer.flush_partial(&out);
  EXPECT_EQ(out, "[rank0]: Password: ");
  prefixer.feed("..", &out);
  prefixer.flush_partial(&out);
  prefixer.feed(". ok\nnext\n", &out);
  EXPECT_EQ(out, "[rank0]: Password: ... ok\n[rank0]: next\n");
  out.clear();
  prefixer.feed("tail", &out);
  prefixer.flush_partial(&out);
  prefixer.finish(&out);
  EXPECT_EQ(out, "[rank0]: tail\n");
  // Ended by the caller for another rank's line: the rest is a line of its own.
  out.clear();
  prefixer.feed("half", &out);
  prefixer.flush_partial(&out);
  EXPECT_TRUE(prefixer.mid_line());
  prefixer.break_line();
  prefixer.feed(" rest\n", &out);
  EXPECT_EQ(out, "[rank0]: half[rank0]:  rest\n");
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
  EXPECT_EQ(env_value(env, "TORCHELASTIC_RUN_ID"), "none");
  EXPECT_EQ(env_value(env, "ROLE_NAME"), "default");
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
