// A rank SIGKILLed at any moment of the shared-memory set-up leaves nothing
// in /dev/shm (Note [Shared memory without a name]); ctest label "faults".
// FSDP_FAULT_SHM_SETUP=<rank>:<step> makes a rank kill itself at each step of
// the set-up in turn; other runs kill a rank after a random delay from its
// start. The other rank must end (with an error), not hang.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>

#include <fsdp/error_message.h>

#include "comm_test_util.h"
#include "detail/posix_files.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace test_shm_faults {

constexpr int kSetupSteps = 6;  // as in shm_links.cpp
const MultiRankOptions kRunOptions{std::chrono::seconds(30), std::chrono::seconds(10), {}};

std::set<std::string> dev_shm_entries() {
  std::set<std::string> names;
  std::error_code ec;
  for (const std::string& name : detail::list_dir("/dev/shm", ec)) names.insert(name);
  EXPECT_FALSE(ec) << "/dev/shm: " << ec.message();
  return names;
}

// The ranks print their pid first thing; collects them.
void collect_pids(const std::vector<RankOutcome>& outcomes, std::set<std::string>* pids) {
  static const std::regex pid_line("rank pid (\\d+)");
  for (const auto& o : outcomes) {
    std::smatch m;
    if (std::regex_search(o.output, m, pid_line)) pids->insert(m[1]);
  }
}

// Entries of /dev/shm that appeared since `before` and may be this test's: a
// libfsdp segment ("fsdp-<pid>-..." when it had names) of one of `pids`, or any
// other new name with "fsdp" in it. Other programs' files are not ours to judge.
std::vector<std::string> left_behind(const std::set<std::string>& before,
                                     const std::set<std::string>& pids) {
  static const std::regex named("fsdp-(\\d+)-.*");
  std::vector<std::string> ours;
  for (const auto& name : dev_shm_entries()) {
    if (before.count(name) || name.find("fsdp") == std::string::npos) continue;
    std::smatch m;
    if (std::regex_match(name, m, named) && pids.count(m[1]) == 0) continue;  // another job's
    ours.push_back(name);
  }
  return ours;
}

void join_and_use(int rank) {
  std::cout << "rank pid " << getpid() << std::endl;
  try {
    auto pg = join(Backend::kGloo, std::chrono::seconds(3));
    const int64_t s = 1 << 20;  // large enough for shared memory
    at::Tensor flat = at::zeros({pg->size() * s});
    for (int i = 0; i < 20; ++i) pg->all_gather_into_tensor(flat, at::ones({s})).wait();
    std::cout << "rank " << rank << " finished" << std::endl;
  } catch (const std::exception& e) {
    std::cout << "rank " << rank << " failed: " << error_message(e) << std::endl;
  }
}

class ShmSetupKill : public ::testing::TestWithParam<int> {};

TEST_P(ShmSetupKill, AtEveryStepLeavesNothingInDevShm) {
  const int victim = GetParam();
  const auto before = dev_shm_entries();
  std::set<std::string> pids;
  for (int step = 1; step <= kSetupSteps; ++step) {
    MultiRankOptions options = kRunOptions;
    options.env["FSDP_FAULT_SHM_SETUP"] = std::to_string(victim) + ":" + std::to_string(step);
    auto outcomes = run_ranks(
        2, [](int rank, int) { join_and_use(rank); }, options);
    if (outcomes.empty()) continue;  // a rank process: on to its own run
    collect_pids(outcomes, &pids);
    EXPECT_EQ(outcomes[victim].term_signal, SIGKILL)
        << "step " << step << ": the hook did not fire. " << describe(outcomes[victim]);
    const auto& other = outcomes[1 - victim];
    EXPECT_FALSE(other.killed_at_deadline) << "step " << step << ": " << describe(other);
  }
  EXPECT_EQ(pids.size(), 2u * kSetupSteps);
  const auto left = left_behind(before, pids);
  EXPECT_TRUE(left.empty()) << left.size() << " files left in /dev/shm, e.g. " << left[0];
}

INSTANTIATE_TEST_SUITE_P(Victim, ShmSetupKill, ::testing::Values(0, 1),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "Rank" + std::to_string(info.param);
                         });

TEST(ShmSetupKill, AtRandomMomentsOfStartUpLeavesNothingInDevShm) {
  const auto before = dev_shm_entries();
  std::set<std::string> pids;
  std::mt19937 rng(2026);
  for (int run = 0; run < 6; ++run) {
    const int victim = run % 2;
    const int delay_ms = static_cast<int>(rng() % 2500);  // start-up takes ~1-2 s here
    auto outcomes = run_ranks(
        2,
        [victim, delay_ms](int rank, int) {
          if (rank == victim) {
            std::thread([delay_ms] {
              std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
              ::raise(SIGKILL);
            }).detach();
          }
          join_and_use(rank);
          if (rank == victim) std::this_thread::sleep_for(std::chrono::seconds(5));
        },
        kRunOptions);
    if (outcomes.empty()) continue;  // a rank process: on to its own run
    collect_pids(outcomes, &pids);
    EXPECT_EQ(outcomes[victim].term_signal, SIGKILL) << describe(outcomes[victim]);
    EXPECT_FALSE(outcomes[1 - victim].killed_at_deadline) << describe(outcomes[1 - victim]);
  }
  const auto left = left_behind(before, pids);
  EXPECT_TRUE(left.empty()) << left.size() << " files left in /dev/shm, e.g. " << left[0];
}

}  // namespace test_shm_faults
}  // namespace fsdp::testing
