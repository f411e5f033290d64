// libfsdp programs under faults (ctest label "faults"): under fsdprun any
// loopback --master-addr works (the store listens on what ranks dial); a rank
// that outlives a killed peer prints its error in one line, without a C++
// backtrace.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "detail/posix_files.h"
#include "free_port.h"
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

// Starts `program args` as ranks 0 and 1 of a job by hand (fsdprun would stop
// the survivor before it prints), rank `victim` SIGKILLing itself at the shared-
// memory set-up step `step` (a test hook of libfsdp); returns the survivor's
// stderr, each rank bounded by `timeout 40`.
std::string survivor_stderr(const std::string& program, int victim, int step) {
  char dir_template[] = "/tmp/fsdp_fault_XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  // Outside the ephemeral range (Note [Test ports outside the ephemeral
  // range]): a port there taken by another test's connect() made rank 0 fail
  // to listen, and rank 1 report something else than the lost store.
  const std::string port = std::to_string(fsdp::testing::free_port());
  std::string script;
  for (int rank : {0, 1}) {
    script += "RANK=" + std::to_string(rank) +
              " WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port +
              " FSDP_FAULT_SHM_SETUP=" + std::to_string(victim) + ":" + std::to_string(step) +
              " OMP_NUM_THREADS=1 timeout 40 " + program + " >" + dir + "/out" +
              std::to_string(rank) + " 2>" + dir + "/err" + std::to_string(rank) + " & ";
  }
  script += "wait";
  EXPECT_EQ(std::system(("env -u TORCH_SHOW_CPP_STACKTRACES sh -c '" + script + "'").c_str()), 0);
  std::ifstream in(dir + "/err" + std::to_string(1 - victim));
  std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::error_code ignored;
  fsdp::detail::remove_tree(dir, ignored);
  return err;
}

TEST(FsdprunFaults, PeerKilledAtStartUpGivesTrainGptAnErrorWithoutBacktrace) {
  const std::string err = survivor_stderr(std::string(TRAIN_GPT_PATH) +
                                              " --layers 1 --d-model 16 --heads 2 --seq-len 16 "
                                              "--batch-size 4 --corpus-chars 5000 --steps 2 "
                                              "--sample-tokens 0 --progress log",
                                          1, 6);
  std::cout << "rank 0's stderr:\n" << err;
  EXPECT_NE(err.find("train_gpt [rank 0]:"), std::string::npos) << err;
  EXPECT_EQ(err.find("frame #"), std::string::npos) << err;
  EXPECT_EQ(err.find("Exception raised from"), std::string::npos) << err;
}

TEST(FsdprunFaults, RankZeroKilledAtStartUpGivesTheOthersOneLine) {
  // Rank 0 serves the store; rank 1's next store request fails.
  const std::string err = survivor_stderr(COMM_DEMO_PATH, 0, 3);
  std::cout << "rank 1's stderr:\n" << err;
  EXPECT_NE(err.find("lost the connection to the rendezvous store"), std::string::npos) << err;
  EXPECT_EQ(err.find("frame #"), std::string::npos) << err;
}

}  // namespace
}  // namespace fsdp::launch::testing
