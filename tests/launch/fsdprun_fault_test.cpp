// fsdprun with libfsdp programs under faults (ctest label "faults"): any
// loopback --master-addr works (the store listens on what ranks dial), and a
// job whose rank dies prints its errors in one line, without C++ backtraces.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <sstream>
#include <string>
#include <vector>

#include "launch_test_util.h"

namespace fsdp::launch::testing {
namespace {

bool have_ipv6_loopback() {
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  if (fd >= 0) ::close(fd);
  return ok;
}

class MasterAddr : public ::testing::TestWithParam<std::string> {};

TEST_P(MasterAddr, LoopbackAddressRunsTheJob) {
  const std::string addr = GetParam();
  if (addr == "::1" && !have_ipv6_loopback()) GTEST_SKIP() << "no IPv6 loopback";
  const RunResult r = run_launcher({"--nproc-per-node", "2", "--master-addr", addr, COMM_DEMO_PATH},
                                   {}, std::chrono::seconds(50));
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("all_reduce counted 2 ranks"), std::string::npos) << r.out << r.err;
}

INSTANTIATE_TEST_SUITE_P(Loopback, MasterAddr, ::testing::Values("127.0.0.2", "::1", "localhost"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param == "::1"         ? std::string("IPv6")
                                  : info.param == "localhost" ? std::string("Localhost")
                                                              : std::string("IPv4NotDotOne");
                         });

TEST(FsdprunFaults, RankKilledAtStartUpGivesErrorsWithoutBacktraces) {
  // Rank 1 SIGKILLs itself at the end of the shared-memory set-up (a test
  // hook of libfsdp); rank 0 fails its first collective and says so.
  const RunResult r =
      run_launcher({"--nproc-per-node",
                    "2",
                    TRAIN_GPT_PATH,
                    "--layers",
                    "1",
                    "--d-model",
                    "16",
                    "--heads",
                    "2",
                    "--seq-len",
                    "16",
                    "--batch-size",
                    "4",
                    "--corpus-chars",
                    "5000",
                    "--steps",
                    "2",
                    "--sample-tokens",
                    "0",
                    "--progress",
                    "log"},
                   {{"FSDP_FAULT_SHM_SETUP", "1:6"}, {"TORCH_SHOW_CPP_STACKTRACES", std::nullopt}},
                   std::chrono::seconds(50));
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("train_gpt [rank 0]:"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("frame #"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("Exception raised from"), std::string::npos) << r.err;
  std::istringstream lines(r.err);
  for (std::string line; std::getline(lines, line);) std::cout << "stderr: " << line << "\n";
}

TEST(FsdprunFaults, RankZeroKilledAtStartUpGivesTheOthersOneLine) {
  // Rank 0 (which serves the store) dies; rank 1's store request fails.
  const RunResult r = run_launcher({"--nproc-per-node", "2", COMM_DEMO_PATH},
                                   {{"FSDP_FAULT_SHM_SETUP", "0:3"}}, std::chrono::seconds(50));
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("lost the connection to the rendezvous store"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("frame #"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace fsdp::launch::testing
