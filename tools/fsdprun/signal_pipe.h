#pragma once

// Turns asynchronous signals into a file descriptor the supervisor can poll,
// so all real work happens in the main loop and not in signal handlers.

#include <signal.h>

#include <vector>

namespace fsdp::launch {

/// Self-pipe for the termination signals (those fsdprun forwards to the
/// ranks: --signals-to-handle) and SIGCHLD. The handlers only record the
/// signal and write one byte; the main loop wakes up from poll() and does
/// the rest. At most one instance may exist at a time (handlers are
/// process-wide).
class SignalPipe {
 public:
  /// Creates the pipe and installs the handlers for `termination`
  /// (LaunchOptions::signals_to_handle) and SIGCHLD. SIGINT, SIGHUP
  /// and SIGQUIT that were ignored when fsdprun started (nohup, `cmd &` in a
  /// script) stay ignored, as shells expect; SIGPIPE is ignored so a closed
  /// stdout cannot kill fsdprun while ranks are running. Throws
  /// std::system_error on failure.
  explicit SignalPipe(const std::vector<int>& termination);
  /// Restores the original dispositions and closes the pipe.
  ~SignalPipe();
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  /// The end to poll for POLLIN.
  int read_fd() const { return read_fd_; }

  /// Empties the pipe after poll() reported it readable.
  void drain() const;

  /// The first termination signal received (decides the exit code), or 0.
  int first_termination_signal() const;

  /// The most recent termination signal received, or 0.
  int last_termination_signal() const;

  /// How many termination signals have arrived; lets the caller notice
  /// repeated signals (each one is forwarded again).
  int termination_count() const;

  /// For a forked child before exec: puts back the dispositions fsdprun
  /// inherited, so the program does not start with SIGPIPE ignored. Only
  /// calls async-signal-safe functions.
  void restore_in_child() const;

 private:
  /// The termination signals, then SIGCHLD and SIGPIPE; with each, the
  /// disposition fsdprun inherited and whether it was replaced. Sized in the
  /// constructor: restore_in_child() runs after fork and must not allocate.
  std::vector<int> handled_;
  std::vector<struct sigaction> saved_;
  std::vector<char> installed_;
  int read_fd_ = -1;
  int write_fd_ = -1;
};

}  // namespace fsdp::launch
