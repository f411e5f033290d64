#pragma once

// Turns asynchronous signals into a file descriptor the supervisor can poll,
// so all real work happens in the main loop and not in signal handlers.

#include <signal.h>

namespace fsdp::launch {

/// Self-pipe for SIGINT, SIGTERM, SIGHUP and SIGCHLD. The handlers only
/// record the signal and write one byte; the main loop wakes up from poll()
/// and does the rest. At most one instance may exist at a time (handlers are
/// process-wide).
class SignalPipe {
 public:
  /// Creates the pipe and installs the handlers. SIGINT and SIGHUP that were
  /// ignored when fsdprun started (nohup, `cmd &` in a script) stay ignored,
  /// as shells expect; SIGPIPE is ignored so a closed stdout cannot kill
  /// fsdprun while ranks are running. Throws std::system_error on failure.
  SignalPipe();
  /// Restores the original dispositions and closes the pipe.
  ~SignalPipe();
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  /// The end to poll for POLLIN.
  int read_fd() const { return read_fd_; }

  /// Empties the pipe after poll() reported it readable.
  void drain() const;

  /// The first SIGINT/SIGTERM/SIGHUP received (decides the exit code), or 0.
  int first_termination_signal() const;

  /// The most recent SIGINT/SIGTERM/SIGHUP received, or 0.
  int last_termination_signal() const;

  /// How many SIGINT/SIGTERM/SIGHUP have arrived; lets the caller notice
  /// repeated signals (each one is forwarded again).
  int termination_count() const;

  /// For a forked child before exec: puts back the dispositions fsdprun
  /// inherited, so the program does not start with SIGPIPE ignored. Only
  /// calls async-signal-safe functions.
  void restore_in_child() const;

 private:
  static constexpr int kNumHandled = 5;
  static const int kHandled[kNumHandled];
  struct sigaction saved_[kNumHandled];
  bool installed_[kNumHandled] = {};
  int read_fd_ = -1;
  int write_fd_ = -1;
};

}  // namespace fsdp::launch
