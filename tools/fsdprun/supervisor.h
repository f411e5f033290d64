#pragma once

// Runs one attempt of a job: starts every local rank, relays their output,
// reacts to failures and signals, and reaps everything before returning
// (but a rank that outlives SIGKILL, which it names and leaves).

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "line_prefixer.h"
#include "options.h"
#include "output_writer.h"
#include "signal_pipe.h"

namespace fsdp::launch {

/// How one attempt ended.
struct AttemptResult {
  enum class Outcome {
    kSucceeded,    ///< Every rank exited with status 0.
    kRankFailed,   ///< A rank failed (or could not be started).
    kInterrupted,  ///< fsdprun received a signal it forwards (--signals-to-handle).
  };
  Outcome outcome = Outcome::kSucceeded;
  /// kRankFailed: the exit code fsdprun should use (never 0).
  int exit_code = 0;
  /// kRankFailed: e.g. "rank 1 (local rank 1, pid 42) exited with status 3".
  std::string failure;
  /// kInterrupted: the first signal fsdprun received. kRankFailed: a signal
  /// that came after the failure (no restart then), else 0.
  int signal = 0;
  /// A rank outlived SIGKILL and was left running: it may hold the port,
  /// the GPU memory and the files a new attempt needs, so none is started.
  bool abandoned = false;
};

/// Starts and supervises the local ranks of a job, one attempt at a time.
class Supervisor {
 public:
  /// All references must outlive the supervisor. `master_port` is the port
  /// already chosen for the whole job (it stays the same across restarts).
  Supervisor(const LaunchOptions& options, int master_port, std::vector<std::string> base_env,
             const SignalPipe& signals, OutputWriter& out, OutputWriter& err);

  /// Starts all local ranks with TORCHELASTIC_RESTART_COUNT=`restart_count`
  /// and returns once every rank has been reaped and nothing is left in
  /// their process groups, or once a rank outlived SIGKILL by 10 s
  /// (AttemptResult::abandoned). If a signal already arrived, starts nothing.
  AttemptResult run_attempt(int restart_count);

 private:
  using Clock = std::chrono::steady_clock;

  /// One local rank of the current attempt.
  struct Rank {
    int rank = 0;
    int local_rank = 0;
    pid_t pid = -1;  ///< Also the process-group id.
    bool exited = false;
    int wait_status = 0;
    /// Set once the leader is reaped and the group was seen empty: from then
    /// on the id may be reused, so the group is never signalled again.
    bool group_gone = false;
    int fds[2] = {-1, -1};                ///< stdout, stderr read ends.
    bool shown = true;                    ///< Not filtered out by --local-ranks-filter.
    bool console[2] = {true, true};       ///< Not only in a log file (--redirects).
    int log_fds[2] = {-1, -1};            ///< --redirects / --tee files, per stream.
    std::vector<LinePrefixer> prefixers;  ///< One per entry of fds.
    /// Since when each stream's prefixer holds a partial line (flushed once
    /// the rank is quiet for kIdleFlush); unset while it holds none.
    std::optional<std::chrono::steady_clock::time_point> partial_since[2];
  };

  /// "local rank 1 (pid 123)", or "local ranks 0 (pid 122), 1 (pid 123)":
  /// the ranks not yet reaped, for the messages about stopping them.
  std::string running_ranks() const;
  /// Forks every rank; on a fork failure records it and stops the others.
  void start_ranks(int restart_count);
  /// " (node N, host H, at <local time>)" and, where it is logged, the
  /// rank's stderr file: for a failure's line.
  std::string where_and_when(const Rank& rank) const;
  /// "[rank<N>]: ", --log-line-prefix-template filled in for `rank`, or
  /// "" with --no-prefix.
  std::string line_prefix(const Rank& rank) const;
  /// Forwards the termination signals that arrived since the last call.
  void forward_new_signals();
  /// Reaps every exited child (ranks, and orphans adopted as subreaper) and
  /// records the first failing rank.
  void reap_children();
  /// Signals every rank's process group and, the first time, starts the
  /// kill-timeout clock.
  void stop_all(int signo);
  /// Sends `signo` to every process group that may still have members.
  void signal_groups(int signo);
  /// True when some rank's process group still has members; marks groups
  /// found empty after their leader was reaped.
  bool any_group_alive();
  /// True when every rank's leader process has been reaped.
  bool all_ranks_exited() const;
  /// Waits in poll() for output or a signal, at most until `timeout_ms`
  /// (-1: no limit), then relays whatever output arrived.
  void wait_and_relay(int timeout_ms);
  /// Shows the partial lines of streams quiet for kIdleFlush (a prompt,
  /// dots of progress); returns the ms until the next is due (-1: none).
  int flush_idle_partials();
  /// Reads one chunk from a rank's stream and relays its complete lines;
  /// on end of stream flushes the partial line and closes the descriptor.
  void relay(Rank& rank, int stream);
  /// Relays everything already buffered in the pipes without waiting, then
  /// flushes partial lines and closes every descriptor.
  void drain_outputs();
  /// Writes a rank's relayed `lines` to fsdprun's stream `stream`, unless
  /// --local-ranks-filter hides that rank.
  void emit(Rank& rank, int stream, const std::string& lines);
  /// Closes rank's stream `stream`, and its log file.
  void close_stream(Rank& rank, int stream);
  /// Records `message` as the attempt's failure unless one is recorded.
  void record_failure(std::string message, int exit_code);

  const LaunchOptions& options_;
  const int master_port_;
  const std::vector<std::string> base_env_;
  const SignalPipe& signals_;
  OutputWriter& out_;
  OutputWriter& err_;
  /// Termination signals already forwarded; kept across attempts.
  int forwarded_signal_count_ = 0;

  // State of the current attempt.
  std::vector<Rank> ranks_;
  std::optional<AttemptResult> failure_;
  bool failed_before_signal_ = false;  // failure_ came before any signal
  int attempt_ = 0;                    // this attempt's restart count
  bool stopping_ = false;
  /// The signal that began stopping the ranks (named when SIGKILL follows).
  int stop_signal_ = SIGTERM;
  Clock::time_point kill_deadline_;
  std::optional<Clock::time_point> killed_at_;
};

}  // namespace fsdp::launch
