#include "supervisor.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>

#include "child_process.h"
#include "deadline.h"
#include "exit_status.h"
#include "rank_env.h"
#include "rank_logs.h"

namespace fsdp::launch {
namespace {

/// Bytes read from a rank's pipe per poll() wake-up; one chunk per stream per
/// round keeps a chatty rank from starving the others.
constexpr size_t kReadChunk = 64 * 1024;

/// How long a partial line waits for its end before it is shown as it is:
/// a line written in pieces (a rank descheduled between two writes of its
/// stdio buffer, on a loaded node) stays whole, a prompt does not wait
/// forever.
constexpr std::chrono::milliseconds kIdleFlush{1000};

/// After SIGKILL, how long to keep waiting for group members that are not
/// our children (they may be reparented elsewhere if setsid'd children fork
/// again); our own children are always waited for.
constexpr std::chrono::seconds kGroupGrace{2};

/// Poll period while waiting for processes whose exit sends us no SIGCHLD.
constexpr int kGroupPollMs = 20;

/// After SIGKILL, how long to wait for a rank itself: one that outlives it
/// is stuck in the kernel (an uninterruptible GPU or network driver call)
/// and may never exit; fsdprun leaves it and ends, as torchrun does, rather
/// than wait forever.
constexpr std::chrono::seconds kUnkillableGrace{10};

}  // namespace

Supervisor::Supervisor(const LaunchOptions& options, int master_port,
                       std::vector<std::string> base_env, const SignalPipe& signals,
                       OutputWriter& out, OutputWriter& err)
    : options_(options),
      master_port_(master_port),
      base_env_(std::move(base_env)),
      signals_(signals),
      out_(out),
      err_(err) {}

AttemptResult Supervisor::run_attempt(int restart_count) {
  ranks_.clear();
  failure_.reset();
  stopping_ = false;
  killed_at_.reset();

  AttemptResult interrupted;
  interrupted.outcome = AttemptResult::Outcome::kInterrupted;
  if (signals_.termination_count() > 0) {
    interrupted.signal = signals_.first_termination_signal();
    return interrupted;
  }

  start_ranks(restart_count);
  bool cleanup_started = false;
  bool abandoned = false;
  while (true) {
    forward_new_signals();
    reap_children();
    const bool ranks_done = all_ranks_exited();
    if (ranks_done) {
      if (!any_group_alive()) break;
      if (!cleanup_started) {
        // Every rank is gone but something it started is still in its
        // process group; left alone it would outlive the job as an orphan.
        cleanup_started = true;
        stop_all(SIGTERM);
      }
      if (killed_at_ && Clock::now() >= *killed_at_ + kGroupGrace) break;
    }
    if (stopping_ && !killed_at_ && Clock::now() >= kill_deadline_) {
      std::ostringstream after;
      after << options_.kill_timeout_s;
      err_.write("fsdprun: " + running_ranks() + " still running " + after.str() + " s after " +
                 signal_name(stop_signal_) + "; sending SIGKILL\n");
      signal_groups(SIGKILL);
      killed_at_ = Clock::now();
    }
    if (!ranks_done && killed_at_ && Clock::now() >= *killed_at_ + kUnkillableGrace) {
      err_.write("fsdprun: " + running_ranks() + " did not exit " +
                 std::to_string(kUnkillableGrace.count()) +
                 " s after SIGKILL (stuck in the kernel: a GPU or network driver call?); "
                 "leaving it and ending, without a restart\n");
      abandoned = true;
      break;
    }

    int timeout_ms = -1;
    if (stopping_ && !killed_at_) timeout_ms = ms_until(kill_deadline_);
    if (killed_at_ && !ranks_done) timeout_ms = ms_until(*killed_at_ + kUnkillableGrace);
    if (ranks_done) {
      timeout_ms = timeout_ms < 0 ? kGroupPollMs : std::min(timeout_ms, kGroupPollMs);
    }
    wait_and_relay(timeout_ms);
  }
  drain_outputs();

  // A failure that came first stays the news (its exit code, the rank's),
  // whatever signal came while the other ranks stopped (torchrun reports the
  // failed rank too); the signal still ends the job without a restart.
  const bool signalled = signals_.termination_count() > 0;
  if (failure_ && (!signalled || failed_before_signal_)) {
    AttemptResult failed = *failure_;
    if (signalled) failed.signal = signals_.first_termination_signal();
    failed.abandoned = abandoned;
    return failed;
  }
  if (signalled) {
    interrupted.signal = signals_.first_termination_signal();
    return interrupted;
  }
  return AttemptResult{};
}

void Supervisor::start_ranks(int restart_count) {
  attempt_ = restart_count;
  for (int local = 0; local < options_.nproc_per_node; ++local) {
    // A signal during start-up: do not start more ranks just to stop them.
    if (signals_.termination_count() != forwarded_signal_count_) return;
    Rank rank;
    rank.local_rank = local;
    rank.rank = options_.node_rank * options_.nproc_per_node + local;
    rank.prefixers.assign(2, LinePrefixer(line_prefix(rank)));
    const std::vector<int>& filter = options_.local_ranks_filter;
    rank.shown = filter.empty() || std::find(filter.begin(), filter.end(), local) != filter.end();
    const int redirected = options_.redirects.of(local);
    const int teed = options_.tee.of(local);
    for (int stream = 0; stream < 2; ++stream) {
      const int bit = 1 << stream;
      rank.console[stream] = (redirected & bit) == 0 || (teed & bit) != 0;
      if (((redirected | teed) & bit) == 0) continue;
      std::string error;
      rank.log_fds[stream] = open_rank_log(options_.log_dir, restart_count, local, stream, &error);
      if (rank.log_fds[stream] < 0) {
        err_.write("fsdprun: " + error + "; local rank " + std::to_string(local) +
                   "'s output stays on the console\n");
        rank.console[stream] = true;
      }
    }
    try {
      const SpawnedProcess child = spawn_process(
          options_.command,
          build_rank_environment(options_, master_port_, local, restart_count, base_env_),
          signals_);
      rank.pid = child.pid;
      rank.fds[0] = child.stdout_fd;
      rank.fds[1] = child.stderr_fd;
    } catch (const std::system_error& e) {
      record_failure("could not start rank " + std::to_string(rank.rank) + " (local rank " +
                         std::to_string(local) + "): " + e.what(),
                     1);
      for (const int fd : rank.log_fds) {
        if (fd >= 0) ::close(fd);
      }
      stop_all(SIGTERM);
      return;
    }
    ranks_.push_back(std::move(rank));
  }
}

std::string Supervisor::line_prefix(const Rank& rank) const {
  if (!options_.prefix_output) return "";
  if (options_.log_line_prefix_template.empty()) return "[rank" + std::to_string(rank.rank) + "]: ";
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return expand_prefix_template(options_.log_line_prefix_template,
                                {{"rank", std::to_string(rank.rank)},
                                 {"local_rank", std::to_string(rank.local_rank)},
                                 {"role_name", options_.role},
                                 {"hostname", host}});
}

void Supervisor::forward_new_signals() {
  const int count = signals_.termination_count();
  if (count == forwarded_signal_count_) return;
  forwarded_signal_count_ = count;
  const int signo = signals_.last_termination_signal();
  if (!stopping_) {
    err_.write("fsdprun: received " + signal_name(signo) + "; forwarding it to all ranks\n");
  }
  stop_all(signo);
}

void Supervisor::reap_children() {
  while (true) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno == EINTR) continue;
    if (pid <= 0) return;  // Nothing more has exited (or no children).
    // Not a rank: an orphan adopted because fsdprun is a child subreaper.
    auto it = std::find_if(ranks_.begin(), ranks_.end(),
                           [&](const Rank& r) { return r.pid == pid && !r.exited; });
    if (it == ranks_.end()) continue;
    it->exited = true;
    it->wait_status = status;
    // Once stopping, ranks dying from our own SIGTERM are not news.
    if (!is_success(status) && !stopping_) {
      record_failure("rank " + std::to_string(it->rank) + " (local rank " +
                         std::to_string(it->local_rank) + ", pid " + std::to_string(pid) + ") " +
                         describe_wait_status(status) + where_and_when(*it),
                     exit_code_for(status));
      stop_all(SIGTERM);
    }
  }
}

std::string Supervisor::where_and_when(const Rank& rank) const {
  // As torchrun's failure summary: every node prints its own line, and the
  // first failure (the others' usually follow from it) is found by these.
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  char when[32] = {};
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  ::localtime_r(&now, &local);
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", &local);
  std::string out =
      " (node " + std::to_string(options_.node_rank) + ", host " + host + ", at " + when + ")";
  if (((options_.redirects.of(rank.local_rank) | options_.tee.of(rank.local_rank)) & 2) != 0) {
    out += "; its stderr: " + rank_log_path(options_.log_dir, attempt_, rank.local_rank, 1);
  }
  return out;
}

void Supervisor::stop_all(int signo) {
  if (!stopping_) {
    stopping_ = true;
    stop_signal_ = signo;
    kill_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(options_.kill_timeout_s));
  }
  signal_groups(signo);
}

namespace {
// FSDP_FAULT_SIGKILL_MISSES=<local rank>: SIGKILL is not sent to that rank,
// as it does not end a rank stuck in the kernel
// (tests/launch/fsdprun_lifecycle_test.cpp).
bool sigkill_misses(int signo, int local_rank) {
  if (signo != SIGKILL) return false;
  const char* fault = std::getenv("FSDP_FAULT_SIGKILL_MISSES");
  return fault != nullptr && std::to_string(local_rank) == fault;
}
}  // namespace

void Supervisor::signal_groups(int signo) {
  for (Rank& rank : ranks_) {
    if (rank.group_gone || sigkill_misses(signo, rank.local_rank)) continue;
    if (::kill(-rank.pid, signo) == 0 || errno != ESRCH) continue;
    if (rank.exited) {
      rank.group_gone = true;
    } else {
      // Started but not yet through setsid(): no group exists yet, and the
      // child is the only process that could be in it.
      ::kill(rank.pid, signo);
    }
  }
}

bool Supervisor::any_group_alive() {
  bool alive = false;
  for (Rank& rank : ranks_) {
    if (rank.group_gone) continue;
    if (!rank.exited) {
      alive = true;
      continue;
    }
    // Signal 0 only checks existence. While the group has a member its id
    // cannot be reused, so once it is empty we stop touching it.
    if (::kill(-rank.pid, 0) != 0 && errno == ESRCH) {
      rank.group_gone = true;
    } else {
      alive = true;
    }
  }
  return alive;
}

std::string Supervisor::running_ranks() const {
  std::string out;
  int n = 0;
  for (const Rank& r : ranks_) {
    if (r.exited) continue;
    out += (n++ == 0 ? "" : ", ") + std::to_string(r.local_rank) + " (pid " +
           std::to_string(r.pid) + ")";
  }
  if (n == 0) return "processes the ranks started";  // the ranks are gone
  return (n == 1 ? "local rank " : "local ranks ") + out;
}

bool Supervisor::all_ranks_exited() const {
  return std::all_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.exited; });
}

int Supervisor::flush_idle_partials() {
  const auto now = std::chrono::steady_clock::now();
  int next = -1;
  for (Rank& rank : ranks_) {
    for (int stream = 0; stream < 2; ++stream) {
      auto& since = rank.partial_since[stream];
      if (!since) continue;
      if (now - *since >= kIdleFlush) {
        std::string lines;
        rank.prefixers[stream].flush_partial(&lines);
        emit(rank, stream, lines);
        since.reset();
        continue;
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(*since + kIdleFlush - now).count();
      const int ms = static_cast<int>(left) + 1;
      next = next < 0 ? ms : std::min(next, ms);
    }
  }
  return next;
}

void Supervisor::wait_and_relay(int timeout_ms) {
  // A quiet rank's partial line is due before the poll would end.
  const int flush_ms = flush_idle_partials();
  if (flush_ms >= 0) timeout_ms = timeout_ms < 0 ? flush_ms : std::min(timeout_ms, flush_ms);
  std::vector<pollfd> pfds;
  std::vector<std::pair<size_t, int>> owners;  // (rank index, stream)
  pfds.push_back(pollfd{signals_.read_fd(), POLLIN, 0});
  for (size_t i = 0; i < ranks_.size(); ++i) {
    for (int stream = 0; stream < 2; ++stream) {
      if (ranks_[i].fds[stream] < 0) continue;
      pfds.push_back(pollfd{ranks_[i].fds[stream], POLLIN, 0});
      owners.emplace_back(i, stream);
    }
  }
  // EINTR (a signal) simply returns to the loop, which looks at the signal.
  if (::poll(pfds.data(), pfds.size(), timeout_ms) <= 0) return;
  if (pfds[0].revents != 0) signals_.drain();
  for (size_t k = 1; k < pfds.size(); ++k) {
    if ((pfds[k].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
    relay(ranks_[owners[k - 1].first], owners[k - 1].second);
  }
}

void Supervisor::relay(Rank& rank, int stream) {
  char buffer[kReadChunk];
  const ssize_t n = ::read(rank.fds[stream], buffer, sizeof(buffer));
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    return;
  }
  std::string lines;
  if (n > 0) {
    // The file gets what the rank wrote, as it wrote it (no prefix). A file
    // that fails (a full disk) is closed, and the console takes over.
    if (rank.log_fds[stream] >= 0 &&
        !OutputWriter(rank.log_fds[stream]).write(std::string_view(buffer, n))) {
      err_.write("fsdprun: cannot write local rank " + std::to_string(rank.local_rank) + "'s " +
                 (stream == 0 ? "stdout" : "stderr") + " log (" + std::strerror(errno) +
                 "); its output goes to the console from here on\n");
      ::close(rank.log_fds[stream]);
      rank.log_fds[stream] = -1;
      rank.console[stream] = true;
    }
    rank.prefixers[stream].feed(std::string_view(buffer, n), &lines);
    // Quiet since now: a partial line is shown once nothing came for a while.
    auto& since = rank.partial_since[stream];
    if (rank.prefixers[stream].pending_bytes() == 0) {
      since.reset();
    } else {
      since = std::chrono::steady_clock::now();
    }
  } else {
    // End of stream (or a broken pipe): the last partial line goes out now.
    rank.prefixers[stream].finish(&lines);
    close_stream(rank, stream);
  }
  emit(rank, stream, lines);
}

void Supervisor::emit(Rank& rank, int stream, const std::string& lines) {
  if (lines.empty() || !rank.shown || !rank.console[stream]) return;
  // Lines never mix: a partial line another rank left shown on this console
  // stream is ended first.
  std::string text;
  for (Rank& other : ranks_) {
    LinePrefixer& prefixer = other.prefixers[stream];
    if (&other != &rank && other.shown && other.console[stream] && prefixer.mid_line()) {
      text = "\n";
      prefixer.break_line();
    }
  }
  text += lines;
  (stream == 0 ? out_ : err_).write(text);
}

void Supervisor::close_stream(Rank& rank, int stream) {
  ::close(rank.fds[stream]);
  rank.fds[stream] = -1;
  rank.partial_since[stream].reset();
  if (rank.log_fds[stream] >= 0) ::close(rank.log_fds[stream]);
  rank.log_fds[stream] = -1;
}

void Supervisor::drain_outputs() {
  for (Rank& rank : ranks_) {
    for (int stream = 0; stream < 2; ++stream) {
      // relay() closes the descriptor at end of stream; EAGAIN means a
      // surviving process still holds the write end and nothing is queued.
      while (rank.fds[stream] >= 0) {
        pollfd pfd{rank.fds[stream], POLLIN, 0};
        if (::poll(&pfd, 1, 0) <= 0) break;
        relay(rank, stream);
      }
      // Whatever still holds the write end (a process that escaped its
      // group) is not worth waiting for once the ranks are gone.
      if (rank.fds[stream] >= 0) {
        std::string lines;
        rank.prefixers[stream].finish(&lines);
        emit(rank, stream, lines);
        close_stream(rank, stream);
      }
    }
  }
}

void Supervisor::record_failure(std::string message, int exit_code) {
  if (failure_) return;
  // Before it is said: a signal sent on reading it comes after it.
  failed_before_signal_ = signals_.termination_count() == 0;
  // Said at once, as torchrun does: the other ranks may take the whole
  // shutdown timeout to stop.
  err_.write("fsdprun: " + message + "; stopping the other ranks\n");
  AttemptResult result;
  result.outcome = AttemptResult::Outcome::kRankFailed;
  result.failure = std::move(message);
  result.exit_code = exit_code != 0 ? exit_code : 1;
  failure_ = std::move(result);
}

}  // namespace fsdp::launch
