#include "launch_test_util.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "detail/posix_files.h"

extern char** environ;

namespace fsdp::launch::testing {
namespace {

using Clock = std::chrono::steady_clock;

/// After the launcher exits, how long to keep reading output that may still
/// sit in the pipes.
constexpr std::chrono::milliseconds kDrainAfterExit{1000};

/// Milliseconds left until `deadline`, at least 0.
int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() > 0 ? static_cast<int>(left.count()) : 0;
}

/// The test's environment with `overrides` applied.
std::vector<std::string> make_env(
    const std::map<std::string, std::optional<std::string>>& overrides) {
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text = *entry;
    if (overrides.count(text.substr(0, text.find('='))) == 0) {
      env.push_back(text);
    }
  }
  for (const auto& [key, value] : overrides) {
    if (value) env.push_back(key + "=" + *value);
  }
  return env;
}

}  // namespace

std::string fsdprun_path() { return FSDPRUN_PATH; }

std::string test_rank_path() { return FSDPRUN_TEST_RANK_PATH; }

LauncherProcess::LauncherProcess(const std::vector<std::string>& args,
                                 const std::map<std::string, std::optional<std::string>>& env)
    : LauncherProcess(fsdprun_path(), args, env) {}

LauncherProcess::LauncherProcess(const std::string& program, const std::vector<std::string>& args,
                                 const std::map<std::string, std::optional<std::string>>& env) {
  std::vector<std::string> argv_strings = {program};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  argv.reserve(argv_strings.size() + 1);
  for (std::string& arg : argv_strings) argv.push_back(arg.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_strings = make_env(env);
  std::vector<char*> envp;
  envp.reserve(env_strings.size() + 1);
  for (std::string& entry : env_strings) envp.push_back(entry.data());
  envp.push_back(nullptr);

  int out_pipe[2];
  int err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) {
    throw std::runtime_error("pipe2 failed");
  }
  const pid_t parent = ::getpid();
  started_ = Clock::now();
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    // If the test binary dies (crash, ctest timeout) the launcher goes too,
    // and its ranks follow through their own parent-death signal.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(126);
    ::dup2(out_pipe[1], STDOUT_FILENO);
    ::dup2(err_pipe[1], STDERR_FILENO);
    ::execve(program.c_str(), argv.data(), envp.data());
    ::_exit(126);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  out_fd_ = out_pipe[0];
  err_fd_ = err_pipe[0];
}

LauncherProcess::~LauncherProcess() {
  if (!reaped_) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &wait_status_, 0);
  }
  if (out_fd_ >= 0) ::close(out_fd_);
  if (err_fd_ >= 0) ::close(err_fd_);
}

void LauncherProcess::send_signal(int signo) const {
  if (!reaped_) ::kill(pid_, signo);
}

void LauncherProcess::pump(int timeout_ms) {
  pollfd pfds[2];
  int* fds[2] = {&out_fd_, &err_fd_};
  std::string* buffers[2] = {&out_, &err_};
  int n = 0;
  int which[2];
  for (int i = 0; i < 2; ++i) {
    if (*fds[i] < 0) continue;
    pfds[n] = pollfd{*fds[i], POLLIN, 0};
    which[n++] = i;
  }
  if (n == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
    return;
  }
  if (::poll(pfds, n, timeout_ms) <= 0) return;
  for (int k = 0; k < n; ++k) {
    if (pfds[k].revents == 0) continue;
    const int i = which[k];
    char buffer[65536];
    const ssize_t got = ::read(*fds[i], buffer, sizeof(buffer));
    if (got > 0) {
      buffers[i]->append(buffer, static_cast<size_t>(got));
    } else if (got == 0 || errno != EINTR) {
      ::close(*fds[i]);
      *fds[i] = -1;
    }
  }
}

bool LauncherProcess::try_reap() {
  if (!reaped_ && ::waitpid(pid_, &wait_status_, WNOHANG) == pid_) {
    reaped_ = true;
  }
  return reaped_;
}

bool LauncherProcess::pump_until(const std::function<bool()>& done,
                                 std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!done()) {
    if (Clock::now() >= deadline) return false;
    pump(std::min(10, ms_left(deadline)));
  }
  return true;
}

RunResult LauncherProcess::wait(std::chrono::milliseconds timeout) {
  RunResult result;
  const auto deadline = Clock::now() + timeout;
  while (!try_reap()) {
    if (Clock::now() >= deadline) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &wait_status_, 0);
      reaped_ = true;
      result.timed_out = true;
      break;
    }
    pump(std::min(20, ms_left(deadline)));
  }
  result.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started_);
  // Output written just before exit may still be in the pipes.
  const auto drain_deadline = Clock::now() + kDrainAfterExit;
  while ((out_fd_ >= 0 || err_fd_ >= 0) && Clock::now() < drain_deadline) {
    pump(ms_left(drain_deadline));
  }
  result.wait_status = wait_status_;
  result.exit_code = WIFEXITED(wait_status_) ? WEXITSTATUS(wait_status_) : -1;
  result.out = out_;
  result.err = err_;
  return result;
}

RunResult run_launcher(const std::vector<std::string>& args,
                       const std::map<std::string, std::optional<std::string>>& env,
                       std::chrono::milliseconds timeout) {
  LauncherProcess launcher(args, env);
  return launcher.wait(timeout);
}

RunResult run_program(const std::string& program, const std::vector<std::string>& args,
                      const std::map<std::string, std::optional<std::string>>& env,
                      std::chrono::milliseconds timeout) {
  LauncherProcess process(program, args, env);
  return process.wait(timeout);
}

PidDir::PidDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern =
      std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/fsdprun-test-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    throw std::runtime_error("mkdtemp failed: " + std::string(std::strerror(errno)));
  }
  path_ = pattern;
}

PidDir::~PidDir() {
  for (pid_t pid : all_pids()) {
    if (!process_gone(pid)) ::kill(pid, SIGKILL);
  }
  std::error_code ignored;
  fsdp::detail::remove_tree(path_, ignored);
}

std::optional<pid_t> PidDir::read(const std::string& name) const {
  std::ifstream file(path_ + "/" + name);
  long pid = 0;
  if (!(file >> pid) || pid <= 0) return std::nullopt;
  return static_cast<pid_t>(pid);
}

bool PidDir::has_all(const std::vector<std::string>& names) const {
  for (const std::string& name : names) {
    if (!read(name)) return false;
  }
  return true;
}

std::vector<pid_t> PidDir::all_pids() const {
  std::vector<pid_t> pids;
  std::error_code ec;
  for (const std::string& name : fsdp::detail::list_dir(path_, ec)) {
    const size_t dot = name.rfind('.');
    if (dot == std::string::npos || dot == 0 || name.substr(dot) != ".pid") continue;
    if (auto pid = read(name)) {
      pids.push_back(*pid);
    }
  }
  return pids;
}

std::vector<std::string> rank_pid_files(int first, int count) {
  std::vector<std::string> names;
  for (int r = first; r < first + count; ++r) {
    names.push_back(std::to_string(r) + ".pid");
  }
  return names;
}

bool process_gone(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, WNOHANG) == pid) return true;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  // A zombie still answers kill(pid, 0) but runs no code any more.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return true;
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos || paren + 2 >= text.size()) return false;
  const char state = text[paren + 2];
  return state == 'Z' || state == 'X';
}

bool wait_gone(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!process_gone(pid)) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  std::string line;
  while (std::getline(stream, line)) lines.push_back(line);
  return lines;
}

int count_occurrences(const std::string& text, const std::string& needle) {
  int count = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos;
       pos = text.find(needle, pos + needle.size())) {
    ++count;
  }
  return count;
}

EnvByRank parse_env(const std::string& out) {
  static const std::regex kLine(R"(^\[rank(\d+)\]: ([A-Z_]+)=(.*)$)");
  EnvByRank env;
  for (const std::string& line : split_lines(out)) {
    std::smatch m;
    if (std::regex_match(line, m, kLine)) env[std::stoi(m[1])][m[2]] = m[3];
  }
  return env;
}

}  // namespace fsdp::launch::testing
