#pragma once

// Helpers for the fsdprun end-to-end tests: run the launcher as a child with
// a deadline, collect its output, and check that processes are gone.

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::launch::testing {

/// Absolute path of the built fsdprun binary.
std::string fsdprun_path();

/// Absolute path of the built fsdprun_test_rank helper.
std::string test_rank_path();

/// What a finished fsdprun run produced.
struct RunResult {
  bool timed_out = false;  ///< The test's deadline hit; fsdprun was killed.
  int wait_status = 0;
  int exit_code = -1;  ///< WEXITSTATUS, or -1 if it did not exit normally.
  std::string out;
  std::string err;
  std::chrono::milliseconds elapsed{0};
};

/// fsdprun running as a child of the test, stdout and stderr captured. The
/// destructor SIGKILLs and reaps it if the test did not, so a failing
/// assertion never leaves it behind.
class LauncherProcess {
 public:
  /// Starts fsdprun with `args`. `env` overrides entries of the test's
  /// environment; a nullopt value removes the variable.
  explicit LauncherProcess(const std::vector<std::string>& args,
                           const std::map<std::string, std::optional<std::string>>& env = {});
  /// Starts `program` (an absolute path: another launcher, such as mpirun)
  /// with `args`, the same way.
  LauncherProcess(const std::string& program, const std::vector<std::string>& args,
                  const std::map<std::string, std::optional<std::string>>& env);
  ~LauncherProcess();
  LauncherProcess(const LauncherProcess&) = delete;
  LauncherProcess& operator=(const LauncherProcess&) = delete;

  /// The launcher's pid.
  pid_t pid() const { return pid_; }

  /// What the launcher wrote to stderr so far (pump_until collects it).
  const std::string& err() const { return err_; }
  /// What the launcher wrote to stdout so far (pump_until collects it).
  const std::string& out() const { return out_; }

  /// Sends `signo` to the launcher (not to its ranks).
  void send_signal(int signo) const;

  /// Collects output until `done()` holds or `timeout` passes; returns
  /// whether `done()` held. Output must keep flowing while waiting, or the
  /// launcher could block on a full pipe.
  bool pump_until(const std::function<bool()>& done, std::chrono::milliseconds timeout);

  /// Collects output until the launcher exits (SIGKILLing it after
  /// `timeout`) and returns the result.
  RunResult wait(std::chrono::milliseconds timeout);

 private:
  /// Reads whatever is available within `timeout_ms` into the buffers.
  void pump(int timeout_ms);
  /// Non-blocking waitpid; true once the launcher has been reaped.
  bool try_reap();

  pid_t pid_ = -1;
  bool reaped_ = false;
  int wait_status_ = 0;
  int out_fd_ = -1;
  int err_fd_ = -1;
  std::string out_;
  std::string err_;
  std::chrono::steady_clock::time_point started_;
};

/// Runs fsdprun to completion (at most `timeout`).
RunResult run_launcher(const std::vector<std::string>& args,
                       const std::map<std::string, std::optional<std::string>>& env = {},
                       std::chrono::milliseconds timeout = std::chrono::seconds(20));

/// Runs `program` (an absolute path) to completion (at most `timeout`).
RunResult run_program(const std::string& program, const std::vector<std::string>& args,
                      const std::map<std::string, std::optional<std::string>>& env,
                      std::chrono::milliseconds timeout);

/// A fresh temporary directory for pid files. The destructor SIGKILLs every
/// pid recorded in it (a safety net for failed tests) and removes it.
class PidDir {
 public:
  PidDir();
  ~PidDir();
  PidDir(const PidDir&) = delete;
  PidDir& operator=(const PidDir&) = delete;

  /// The directory's path.
  const std::string& path() const { return path_; }
  /// The pid in <path>/<name>, if the file exists.
  std::optional<pid_t> read(const std::string& name) const;
  /// True once every file in `names` exists.
  bool has_all(const std::vector<std::string>& names) const;
  /// All pids recorded in *.pid files.
  std::vector<pid_t> all_pids() const;

 private:
  std::string path_;
};

/// "<rank>.pid" for ranks [first, first + count).
std::vector<std::string> rank_pid_files(int first, int count);

/// True when `pid` no longer runs: it does not exist, or is a zombie that
/// nobody reaped yet (reaped here if it is our child).
bool process_gone(pid_t pid);

/// Polls process_gone() until true or `timeout` passes.
bool wait_gone(pid_t pid, std::chrono::milliseconds timeout);

/// Splits text into lines (a missing final '\n' still ends a line).
std::vector<std::string> split_lines(const std::string& text);

/// Number of non-overlapping occurrences of `needle` in `text`.
int count_occurrences(const std::string& text, const std::string& needle);

/// Each rank's launcher variables, by RANK.
using EnvByRank = std::map<int, std::map<std::string, std::string>>;

/// Collects the "[rankN]: KEY=VALUE" lines fsdprun_test_rank --print-env printed.
EnvByRank parse_env(const std::string& out);

}  // namespace fsdp::launch::testing
