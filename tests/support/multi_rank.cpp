#include "multi_rank.h"

#include "rank_zygote.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

namespace fsdp::testing {

namespace {

constexpr const char* kInvocationVar = "FSDP_TEST_INVOCATION";
// Printed by a rank after its body returned, so that a rank process that
// exited 0 without running the body (a harness bug) cannot pass a test.
constexpr const char* kBodyFinished = "[fsdp-test] rank body finished";

// run_ranks calls seen so far in the current test; a rank process runs one test.
int next_invocation() {
  static std::string test;
  static int counter = 0;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = std::string(info->test_suite_name()) + "." + info->name();
  if (name != test) {
    test = name;
    counter = 0;
  }
  return counter++;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string current_test_filter() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string("--gtest_filter=") + info->test_suite_name() + "." + info->name();
}

[[noreturn]] void run_in_child(const std::function<void(int, int)>& body) {
  const int rank = std::atoi(std::getenv("RANK"));
  const int world = std::atoi(std::getenv("WORLD_SIZE"));
  int status = 0;
  try {
    body(rank, world);
    status = ::testing::Test::HasFailure() ? 1 : 0;
    std::cout << kBodyFinished << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "[rank " << rank << "] uncaught exception: " << e.what() << std::endl;
    status = 2;
  }
  std::cout.flush();
  std::cerr.flush();
  std::_Exit(status);
}

}  // namespace

bool is_rank_process() { return std::getenv(kInvocationVar) != nullptr; }

std::string describe(const RankOutcome& o) {
  std::ostringstream os;
  os << "rank " << o.rank;
  if (o.killed_at_deadline)
    os << " was killed at the deadline (hung)";
  else if (o.term_signal != 0)
    os << " was killed by signal " << o.term_signal << " (" << strsignal(o.term_signal) << ")";
  else
    os << " exited with status " << o.exit_code;
  os << "; its output:\n" << o.output;
  return os.str();
}

std::vector<RankOutcome> run_ranks(int world_size, const std::function<void(int, int)>& body,
                                   const MultiRankOptions& options) {
  const int invocation = next_invocation();
  if (const char* want = std::getenv(kInvocationVar)) {
    if (std::atoi(want) == invocation) run_in_child(body);
    return {};  // a rank process skips the other run_ranks calls of its test
  }

  const int port = free_port();
  char dir_template[] = "/tmp/fsdp_test_XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  std::vector<std::string> logs;
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world_size; ++rank) {
    std::map<std::string, std::string> env = options.env;
    env["RANK"] = std::to_string(rank);
    env["LOCAL_RANK"] = std::to_string(rank);
    env["WORLD_SIZE"] = std::to_string(world_size);
    env["LOCAL_WORLD_SIZE"] = std::to_string(world_size);
    env["MASTER_ADDR"] = "127.0.0.1";
    env["MASTER_PORT"] = std::to_string(port);
    env[kInvocationVar] = std::to_string(invocation);
    env["OMP_NUM_THREADS"] = "1";
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string kv(*e);
      if (env.count(kv.substr(0, kv.find('='))) == 0) env_strings.push_back(kv);
    }
    for (auto& [k, v] : env) env_strings.push_back(k + "=" + v);
    logs.push_back(dir + "/rank" + std::to_string(rank) + ".log");
    pids.push_back(spawn_rank({current_test_filter()}, env_strings, logs.back()));
  }

  std::vector<RankOutcome> outcomes(world_size);
  std::vector<bool> done(world_size, false);
  int remaining = world_size;
  const auto start = std::chrono::steady_clock::now();
  auto deadline = start + options.deadline;
  bool saw_failure = false;
  while (remaining > 0) {
    for (int r = 0; r < world_size; ++r) {
      if (done[r]) continue;
      int status = 127 << 8;  // exit status 127 where no process started
      if (pids[r] > 0 && poll_rank(pids[r], status) != pids[r]) continue;
      done[r] = true;
      --remaining;
      outcomes[r].rank = r;
      if (WIFEXITED(status)) outcomes[r].exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) outcomes[r].term_signal = WTERMSIG(status);
      const bool failed = outcomes[r].exit_code != 0;
      if (failed && !saw_failure) {
        saw_failure = true;
        deadline = std::min(deadline, std::chrono::steady_clock::now() + options.failure_grace);
      }
    }
    if (remaining > 0 && std::chrono::steady_clock::now() >= deadline) {
      for (int r = 0; r < world_size; ++r) {
        if (done[r]) continue;
        int status = 0;
        if (pids[r] > 0) {
          kill(pids[r], SIGKILL);
          wait_rank(pids[r], status);
        }
        outcomes[r].rank = r;
        outcomes[r].killed_at_deadline = true;
        outcomes[r].term_signal = SIGKILL;
        done[r] = true;
        --remaining;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int r = 0; r < world_size; ++r) {
    outcomes[r].output = read_file(logs[r]);
    ::unlink(logs[r].c_str());
  }
  ::rmdir(dir.c_str());
  return outcomes;
}

void expect_all_succeeded(const std::vector<RankOutcome>& outcomes) {
  for (const auto& o : outcomes) {
    EXPECT_TRUE(o.exit_code == 0 && o.term_signal == 0) << describe(o);
    EXPECT_NE(o.output.find(kBodyFinished), std::string::npos)
        << "rank " << o.rank << " never ran the test body:\n"
        << o.output;
  }
}

void run_ranks_ok(int world_size, const std::function<void(int, int)>& body,
                  const MultiRankOptions& options) {
  expect_all_succeeded(run_ranks(world_size, body, options));
}

std::string shared_temp_dir(MultiRankOptions& options, const std::string& name) {
  constexpr const char* kVariable = "FSDP_TEST_SHARED_DIR";
  std::string dir;
  if (is_rank_process()) {
    const char* env = std::getenv(kVariable);
    dir = env != nullptr ? env : "";
  } else {
    std::string tmpl = "/tmp/fsdp_" + name + "_XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) dir = tmpl;
  }
  options.env[kVariable] = dir;
  return dir;
}

}  // namespace fsdp::testing
