// init_process_group: environment and options, single-rank groups, sub-groups,
// and what listens where.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <dirent.h>
#include <linux/capability.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/comm/c10d_process_group.h>

#include "detail/torch_compat.h"
#include "rendezvous/tcp_store.h"

#include "comm_test_util.h"
#include "error_of.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace test_process_group {

struct ListeningSocket {
  std::string local_address;  // as in /proc/net/tcp*, hex
  bool loopback;
};

// The listening TCP sockets that belong to this process.
std::vector<ListeningSocket> own_listening_sockets() {
  std::set<std::string> inodes;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) {
      char target[256] = {0};
      const std::string path = std::string("/proc/self/fd/") + e->d_name;
      if (readlink(path.c_str(), target, sizeof(target) - 1) > 0) {
        std::string t(target);
        if (t.rfind("socket:[", 0) == 0) inodes.insert(t.substr(8, t.size() - 9));
      }
    }
    closedir(d);
  }
  std::vector<ListeningSocket> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::string sl, local, remote, state, queues, tr, retr, uid, timeout, inode;
      ls >> sl >> local >> remote >> state >> queues >> tr >> retr >> uid >> timeout >> inode;
      if (state != "0A" || inodes.count(inode) == 0) continue;  // 0A: LISTEN
      const std::string addr = local.substr(0, local.find(':'));
      const bool v4_loopback = addr.size() == 8 && addr.substr(6, 2) == "7F";
      const bool v6_loopback = addr == "00000000000000000000000001000000";
      out.push_back({local, v4_loopback || v6_loopback});
    }
  }
  return out;
}

TEST(ProcessGroup, NothingListensBeyondLoopbackByDefault) {
  run_ranks_ok(2, [](int rank, int) {
    auto pg = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    pg->barrier().wait();
    const auto sockets = own_listening_sockets();
    // Rank 0 serves the store (Gloo's pairs stop listening once connected).
    if (rank == 0) EXPECT_GE(sockets.size(), 1u);
    for (const auto& s : sockets) EXPECT_TRUE(s.loopback) << "listening on " << s.local_address;
    if (rank == 0) {
      // Control: the check does see a store that was told to listen everywhere.
      TcpStore everywhere("127.0.0.1", 0, true, std::chrono::seconds(5), "0.0.0.0");
      bool saw_wildcard = false;
      for (const auto& s : own_listening_sockets()) saw_wildcard = saw_wildcard || !s.loopback;
      EXPECT_TRUE(saw_wildcard);
    }
    pg->barrier().wait();
  });
}

// The threads of this process that run under SCHED_FIFO.
int realtime_threads() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      if (sched_getscheduler(std::atoi(e->d_name)) == SCHED_FIFO) ++n;
    }
    closedir(d);
  }
  return n;
}

// realtime_threads() once it is `expected`, or when `limit` has passed.
int realtime_threads_within(int expected, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (realtime_threads() != expected && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return realtime_threads();
}

// Whether this process may give a thread real-time priority at all.
bool realtime_allowed() {
  bool ok = false;
  std::thread([&] {
    sched_param param{};
    param.sched_priority = 1;
    ok = pthread_setschedparam(pthread_self(), SCHED_FIFO, &param) == 0;
  }).join();
  return ok;
}

// Note [Communication threads preempt compute]: the communication thread and
// the direct links' sender thread take SCHED_FIFO where the process may, the
// caller's threads never do, realtime_threads(false) or FSDP_COMM_REALTIME=0
// keeps every thread as it was (the field winning over the variable), and
// without the privilege the group works the same.
void expect_realtime_comm_threads(const char* env, std::optional<bool> field, bool on) {
  run_ranks_ok(2, [env, field, on](int rank, int) {
    const bool allowed = realtime_allowed();
    if (env != nullptr) setenv("FSDP_COMM_REALTIME", env, 1);
    ASSERT_EQ(realtime_threads(), 0);
    auto options = ProcessGroupOptions().timeout(std::chrono::seconds(30));
    if (field.has_value()) options.realtime_threads(*field);
    auto pg = init_process_group(options);
    // Large enough for the sender thread (above direct_link_bytes).
    at::Tensor flat = at::zeros({2 << 17});
    pg->all_gather_into_tensor(flat, at::full({1 << 17}, static_cast<float>(rank))).wait();
    EXPECT_EQ(flat[0].item<float>(), 0.0f);
    EXPECT_EQ(flat[1 << 17].item<float>(), 1.0f);
    // Each thread takes its policy as it starts, which the collective need
    // not have waited for (it can run on the waiter): under load that came
    // after the count (1 of 10 runs with both cores busy), so wait a while.
    const int expected = allowed && on ? 2 : 0;
    EXPECT_EQ(realtime_threads_within(expected, std::chrono::seconds(5)), expected)
        << "allowed " << allowed;
    EXPECT_EQ(sched_getscheduler(0), SCHED_OTHER);
    pg->barrier().wait();
    pg.reset();
    destroy_process_group();
    // A joined thread's entry in /proc/self/task can outlive the join by a
    // moment (the kernel reaps it after clearing its tid): 1 of ~50 runs
    // under load counted it.
    EXPECT_EQ(realtime_threads_within(0, std::chrono::seconds(5)), 0);
    unsetenv("FSDP_COMM_REALTIME");
  });
}

TEST(ProcessGroup, CommunicationThreadsPreemptComputeWhereAllowed) {
  expect_realtime_comm_threads(nullptr, std::nullopt, true);
}

TEST(ProcessGroup, CommunicationThreadsKeepTheirPolicyWhenTurnedOff) {
  expect_realtime_comm_threads("0", std::nullopt, false);
  expect_realtime_comm_threads(nullptr, false, false);
  expect_realtime_comm_threads("0", true, true);  // the field wins
}

// Takes from this process what real-time scheduling needs (CAP_SYS_NICE,
// RLIMIT_RTPRIO), as a default docker container runs.
void drop_realtime_privilege() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct caps[2] = {};
  ASSERT_EQ(syscall(SYS_capget, &header, caps), 0);
  const uint32_t nice = 1u << CAP_SYS_NICE;  // < 32: in the first word
  caps[0].effective &= ~nice;
  caps[0].permitted &= ~nice;
  caps[0].inheritable &= ~nice;
  ASSERT_EQ(syscall(SYS_capset, &header, caps), 0);
  const rlimit none{0, 0};
  ASSERT_EQ(setrlimit(RLIMIT_RTPRIO, &none), 0);
}

// Without the privilege the group works the same, with no word by default;
// debug mode (the option, or FSDP_DEBUG=detail) says so once on every rank,
// naming the fix, unless the user turned real-time priority off.
void expect_refused_realtime_said(std::optional<bool> debug_option, const char* debug_env,
                                  bool realtime, bool said) {
  run_ranks_ok(2, [=](int rank, int) {
    drop_realtime_privilege();
    ASSERT_FALSE(realtime_allowed());
    if (debug_env != nullptr) setenv("FSDP_DEBUG", debug_env, 1);
    auto options = ProcessGroupOptions().timeout(std::chrono::seconds(30));
    if (debug_option.has_value()) options.debug_collectives(*debug_option);
    if (!realtime) options.realtime_threads(false);
    compat::WarningCollector warnings;
    auto pg = init_process_group(options);
    at::Tensor flat = at::zeros({2 << 17});
    pg->all_gather_into_tensor(flat, at::full({1 << 17}, static_cast<float>(rank))).wait();
    EXPECT_EQ(flat[1 << 17].item<float>(), 1.0f);
    EXPECT_EQ(realtime_threads(), 0);
    EXPECT_EQ(sched_getscheduler(0), SCHED_OTHER) << "the probe must leave the caller alone";
    pg->barrier().wait();
    pg.reset();
    destroy_process_group();
    std::vector<std::string> warned;
    for (const auto& m : warnings.messages) {
      if (m.find("communication threads keep") != std::string::npos) warned.push_back(m);
    }
    ASSERT_EQ(warned.size(), said ? 1u : 0u);
    if (!said) return;
    const std::string expected = "fsdp: rank " + std::to_string(rank) +
                                 "'s communication threads keep the default scheduling priority";
    EXPECT_EQ(warned[0].rfind(expected, 0), 0u) << warned[0];
    EXPECT_NE(warned[0].find("CAP_SYS_NICE"), std::string::npos) << warned[0];
    EXPECT_NE(warned[0].find("FSDP_COMM_REALTIME=0"), std::string::npos) << warned[0];
  });
}

TEST(ProcessGroup, DebugModeSaysWhenRealTimePriorityIsRefused) {
  expect_refused_realtime_said(std::nullopt, nullptr, true, false);  // the default: silent
  expect_refused_realtime_said(true, nullptr, true, true);
  expect_refused_realtime_said(std::nullopt, "detail", true, true);
  expect_refused_realtime_said(true, nullptr, false, false);  // turned off: nothing to say
}

// Where the privilege is there, debug mode has nothing to say about it.
TEST(ProcessGroup, DebugModeIsQuietWhenRealTimePriorityTakes) {
  run_ranks_ok(2, [](int rank, int) {
    if (!realtime_allowed()) GTEST_SKIP() << "this process may not use real-time scheduling";
    compat::WarningCollector warnings;
    auto pg = init_process_group(
        ProcessGroupOptions().timeout(std::chrono::seconds(30)).debug_collectives(true));
    pg->barrier().wait();
    EXPECT_EQ(sched_getscheduler(0), SCHED_OTHER) << "the probe must leave the caller alone";
    pg.reset();
    destroy_process_group();
    for (const auto& m : warnings.messages) {
      EXPECT_EQ(m.find("communication threads keep"), std::string::npos) << m;
    }
  });
}

// Note [A store from an earlier init]: init, destroy and init again in the
// same processes, rank 0 the last to let its group go (the others reach its
// earlier store first), with and without collectives in between.
TEST(ProcessGroup, InitAgainAfterDestroyInTheSameProcesses) {
  run_ranks_ok(3, [](int rank, int world) {
    for (int round = 0; round < 3; ++round) {
      auto pg = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
      if (round != 1) {
        at::Tensor out = at::zeros({world});
        pg->all_gather_into_tensor(out, at::full({1}, static_cast<float>(rank + 10 * round)))
            .wait();
        for (int r = 0; r < world; ++r) {
          EXPECT_EQ(out[r].item<float>(), static_cast<float>(r + 10 * round)) << "round " << round;
        }
      }
      if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      pg.reset();
      destroy_process_group();
    }
  });
}

// A rank that inits again while rank 0 keeps the earlier group fails within
// its timeout, naming the fix, instead of joining the earlier group's store.
TEST(ProcessGroup, InitAgainWhileRankZeroKeepsItsGroupIsAnError) {
  run_ranks_ok(2, [](int rank, int) {
    auto pg = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    pg->barrier().wait();
    if (rank == 0) {
      std::this_thread::sleep_for(std::chrono::seconds(3));  // past rank 1's timeout
    } else {
      pg.reset();
      destroy_process_group();
      const auto start = std::chrono::steady_clock::now();
      const std::string error = error_of(
          [] { init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(1))); });
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
      EXPECT_NE(error.find("still serves an earlier process group"), std::string::npos) << error;
      EXPECT_NE(error.find("destroy_process_group() on every rank"), std::string::npos) << error;
    }
  });
}

TEST(ProcessGroup, SingleRankNeedsNoStoreAndOpensNoSocket) {
  for (const char* var : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(var);
  auto pg = init_process_group();
  EXPECT_EQ(pg->size(), 1);
  EXPECT_EQ(pg->rank(), 0);
  EXPECT_EQ(pg->backend_name(), "local");
  EXPECT_TRUE(own_listening_sockets().empty());
  at::Tensor flat = at::zeros({4});
  pg->all_gather_into_tensor(flat, at::arange(4, at::kFloat)).wait();
  EXPECT_TRUE(at::equal(flat, at::arange(4, at::kFloat)));
  at::Tensor shard = at::zeros({4});
  pg->reduce_scatter_tensor(shard, at::full({4}, 3.0f), ReduceOp::kAvg).wait();
  EXPECT_TRUE(at::all(shard == 3).item<bool>());
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(default_process_group(), pg);
  destroy_process_group();
  EXPECT_FALSE(is_initialized());
  EXPECT_THROW(default_process_group(), c10::Error);
}

TEST(ProcessGroup, BadEnvironmentIsAnErrorNamingTheVariable) {
  setenv("RANK", "abc", 1);
  setenv("WORLD_SIZE", "2", 1);
  try {
    init_process_group();
    ADD_FAILURE() << "RANK=abc was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='abc'"), std::string::npos) << e.what();
  }
  setenv("RANK", "2", 1);
  try {
    init_process_group();
    ADD_FAILURE() << "RANK=2 with WORLD_SIZE=2 was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("world size 2"), std::string::npos) << e.what();
  }
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
}

TEST(ProcessGroup, ExplicitOptionsOverrideTheEnvironment) {
  // Two ranks as threads of one process, configured only through options.
  const int port = free_port();
  std::vector<std::shared_ptr<ProcessGroup>> groups(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      groups[r] = init_process_group(ProcessGroupOptions()
                                         .rank(r)
                                         .world_size(2)
                                         .master_addr("127.0.0.1")
                                         .master_port(port)
                                         .timeout(std::chrono::seconds(20))
                                         .set_default(false));
    });
  }
  for (auto& t : threads) t.join();
  std::vector<at::Tensor> ts{at::full({3}, 1.0f), at::full({3}, 2.0f)};
  std::vector<Work> works{groups[0]->all_reduce(ts[0]), groups[1]->all_reduce(ts[1])};
  for (auto& w : works) w.wait();
  EXPECT_TRUE(at::all(ts[0] == 3).item<bool>());
  EXPECT_TRUE(at::all(ts[1] == 3).item<bool>());
  EXPECT_FALSE(is_initialized());
}

class Subgroups : public ::testing::TestWithParam<Backend> {};

TEST_P(Subgroups, SubgroupsAndNodeGroups) {
  run_ranks_ok(4, [](int rank, int) {
    auto pg = join(GetParam());
    auto odd = pg->new_subgroup({1, 3});
    if (rank % 2 == 1) {
      ASSERT_TRUE(odd);
      EXPECT_EQ(odd->size(), 2);
      EXPECT_EQ(odd->rank(), rank / 2);
      at::Tensor t = at::full({5}, static_cast<float>(rank));
      odd->all_reduce(t).wait();
      EXPECT_TRUE(at::all(t == 4).item<bool>());
    } else {
      EXPECT_FALSE(odd);
    }
    auto node = new_node_subgroup(*pg, 2);
    ASSERT_TRUE(node);
    EXPECT_EQ(node->size(), 2);
    EXPECT_EQ(node->rank(), rank % 2);
    at::Tensor flat = at::zeros({4});
    node->all_gather_into_tensor(flat, at::full({2}, static_cast<float>(rank))).wait();
    const float first = static_cast<float>(rank - rank % 2);
    EXPECT_TRUE(at::equal(flat, at::tensor({first, first, first + 1, first + 1})));
    EXPECT_THROW(pg->new_subgroup({3, 1}), c10::Error);
    EXPECT_THROW(pg->new_subgroup({0, 4}), c10::Error);
    pg->barrier().wait();  // the parent still works beside its sub-groups
  });
}

INSTANTIATE_TEST_SUITE_P(Engines, Subgroups, ::testing::ValuesIn(available_engines()),
                         backend_label);

// A c10d group that calls itself NCCL: no GPU is needed to see the refusal,
// which comes before anything is sent.
class CalledNccl : public c10d::ProcessGroup {
 public:
  CalledNccl() : c10d::ProcessGroup(0, 2) {}
  const std::string getBackendName() const override { return "nccl"; }
};

TEST(ProcessGroup, CpuTensorsOnAC10dNcclGroupAreRefusedByName) {
  C10dProcessGroup group(c10::make_intrusive<CalledNccl>(), std::chrono::seconds(5));
  const at::Tensor t = at::ones({4});
  for (const std::string& what :
       {error_of([&] { group.all_reduce(t, ReduceOp::kSum); }),
        error_of([&] { group.broadcast(t, 0); }),
        error_of([&] { group.all_gather_into_tensor(at::empty({8}), t); }),
        error_of([&] { group.reduce_scatter_tensor(at::empty({2}), t, ReduceOp::kSum); })}) {
    EXPECT_CONTAINS(what, "c10d NCCL group");
    EXPECT_CONTAINS(what, "fsdp::init_process_group()");
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

}  // namespace test_process_group
}  // namespace fsdp::testing
