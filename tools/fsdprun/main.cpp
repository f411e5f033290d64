// fsdprun: a torchrun-compatible launcher for libfsdp programs.

#include <fcntl.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "device_count.h"
#include "exit_status.h"
#include "free_port.h"
#include "job_token.h"
#include "options.h"
#include "output_writer.h"
#include "program_check.h"
#include "rank_env.h"
#include "rank_logs.h"
#include "rendezvous.h"
#include "signal_pipe.h"
#include "supervisor.h"

extern char** environ;

namespace fsdp::launch {
namespace {

/// Exit code for command-line mistakes (argparse's, and torchrun's).
constexpr int kUsageExitCode = 2;

/// Opens /dev/null on any of fds 0-2 that is closed, so that no pipe created
/// later lands on them (children dup2 their pipes onto 1 and 2).
void ensure_standard_fds_open() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1) continue;
    const int null_fd = ::open("/dev/null", O_RDWR);
    if (null_fd >= 0 && null_fd != fd) {
      ::dup2(null_fd, fd);
      ::close(null_fd);
    }
  }
}

/// Everything after argument parsing; returns fsdprun's exit code.
int launch(LaunchOptions options) {
  ensure_standard_fds_open();
  OutputWriter out(STDOUT_FILENO);
  OutputWriter err(STDERR_FILENO);

  // Before any rendezvous: a node that cannot start its ranks says so at once.
  const char* path = std::getenv("PATH");
  if (const auto problem = check_program(
          options, path != nullptr ? std::optional<std::string>(path) : std::nullopt)) {
    err.write("fsdprun: error: " + problem->message + "\n");
    return problem->exit_code;
  }

  std::vector<std::string> notes;
  std::string nproc_error;
  if (!resolve_nproc_per_node(&options, visible_cuda_gpus, usable_cpus(), &notes, &nproc_error)) {
    err.write("fsdprun: error: " + nproc_error + "\n");
    return kUsageExitCode;
  }
  for (const std::string& note : notes) err.write("fsdprun: " + note + "\n");

  // torchrun runs --standalone, and a single-node job given no master port
  // (which it then meets at localhost:0), under an id of its own, a random
  // UUID, so that runs do not share one; an id given with --rdzv-id stays.
  const bool single_node_unnamed = options.rdzv_backend == "static" && !options.master_port &&
                                   options.nnodes == 1 && options.rdzv_id == "none";
  if (options.standalone || single_node_unnamed) {
    std::string id_error;
    options.rdzv_id = random_run_id(&id_error);
    if (options.rdzv_id.empty()) {
      err.write("fsdprun: error: cannot make a run id (" + id_error + ")\n");
      return 1;
    }
  }

  // See Note [Job token] (src/rendezvous/job_token.cpp): before anything is started.
  std::vector<std::string> base_env = environment_from(environ);
  std::string token_error;
  const std::string token = ensure_job_token(options, &base_env, &token_error);
  if (token.empty() && !token_error.empty()) {
    err.write("fsdprun: error: " + token_error + "\n");
    return options.nnodes > 1 ? kUsageExitCode : 1;
  }
  if (token.empty()) {  // a Python program under the static backend (ensure_job_token)
    err.write(
        "fsdprun: FSDP_JOB_TOKEN is unset: the Python program's ranks need none, but libfsdp "
        "processes it starts would accept any peer; export the same one on every node to guard "
        "them\n");
  }

  if (options.redirects.any() || options.tee.any()) {
    std::string log_error;
    options.log_dir = make_run_log_dir(options.log_dir, options.rdzv_id, &log_error);
    if (options.log_dir.empty()) {
      err.write("fsdprun: error: --log-dir: " + log_error + "\n");
      return 1;
    }
    err.write("fsdprun: the ranks' output files: " + options.log_dir +
              "/attempt_<n>/<local rank>/{stdout,stderr}.log\n");
  }

  int port = options.master_port.value_or(0);
  if (!options.master_port) {
    std::string error;
    port = pick_free_port(options.master_addr, &error);
    if (port < 0) {
      err.write("fsdprun: cannot pick a free port (" + error + "); pass --master-port\n");
      return 1;
    }
  }

  // The ranks write into pipes; tell them when what they write ends up on a
  // terminal, so they can draw progress bars (unless the user decided).
  if (::isatty(STDOUT_FILENO) != 0 && std::getenv("FSDPRUN_STDOUT_TTY") == nullptr) {
    base_env.emplace_back("FSDPRUN_STDOUT_TTY=1");
  }
  if (defaults_omp_num_threads(options, base_env)) {
    err.write(
        "fsdprun: setting OMP_NUM_THREADS=1 for each rank to avoid "
        "overloading the node; set it yourself to tune performance\n");
  }

  // Orphans of the ranks (their children, once a rank dies) are reparented
  // to fsdprun rather than init, so fsdprun can reap them and never leaves
  // zombies behind in containers whose init does not reap.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);

  std::unique_ptr<SignalPipe> signals;
  try {
    signals = std::make_unique<SignalPipe>(options.signals_to_handle);
  } catch (const std::exception& e) {
    err.write(std::string("fsdprun: cannot install signal handlers: ") + e.what() + "\n");
    return 1;
  }

  const Hooks hooks{[&err](const std::string& line) { err.write(line + "\n"); },
                    [&signals] { return signals->termination_count() > 0; }};
  Supervisor supervisor(options, port, std::move(base_env), *signals, out, err);
  const int max_nnodes = options.nnodes;  // --nnodes MIN:MAX's MAX, for every meeting
  // Decided once: an elastic job left with one node still meets at restarts.
  const bool meets = options.assigns_node_ranks();
  for (int restart = 0;; ++restart) {
    if (restart > 0) {
      err.write("fsdprun: restarting all ranks (restart " + std::to_string(restart) + "/" +
                std::to_string(options.max_restarts) + ")\n");
    }
    // Every attempt meets anew (Note [fsdprun's rendezvous]): a node
    // started in place of a lost one joins the restarted job.
    if (meets) {
      std::string rendezvous_error;
      Assignment assignment;
      options.nnodes = max_nnodes;
      if (!join_rendezvous(options, token, hooks, &assignment, &rendezvous_error)) {
        if (signals->termination_count() > 0) {
          const int signo = signals->first_termination_signal();
          err.write("fsdprun: stopped by " + signal_name(signo) + "\n");
          return 128 + signo;
        }
        err.write("fsdprun: error: " + rendezvous_error + "\n");
        return 1;
      }
      options.node_rank = assignment.node_rank;
      options.master_addr = assignment.master_addr;
      options.nnodes = assignment.nnodes;
      err.write("fsdprun: node rank " + std::to_string(options.node_rank) + " of " +
                std::to_string(options.nnodes) + "\n");
    }
    const AttemptResult result = supervisor.run_attempt(restart);
    switch (result.outcome) {
      case AttemptResult::Outcome::kSucceeded:
        return 0;
      case AttemptResult::Outcome::kInterrupted:
        err.write("fsdprun: stopped by " + signal_name(result.signal) + "\n");
        return 128 + result.signal;
      // The supervisor said which rank failed, at once; the other ranks'
      // output (their tracebacks, shutdown messages) came after it, so the
      // last line names it again, as torchrun's summary does.
      case AttemptResult::Outcome::kRankFailed:
        if (result.signal != 0) {
          err.write("fsdprun: stopped by " + signal_name(result.signal) +
                    " after that failure: " + result.failure + "\n");
          return result.exit_code;
        }
        if (restart < options.max_restarts && !result.abandoned) continue;
        if (result.abandoned) {
          err.write("fsdprun: job failed, without a restart (a rank outlived SIGKILL): " +
                    result.failure + "\n");
        } else if (options.max_restarts > 0) {
          err.write("fsdprun: giving up after " + std::to_string(options.max_restarts) +
                    " restarts; the last failure: " + result.failure + "\n");
        } else {
          err.write("fsdprun: job failed: " + result.failure + "\n");
        }
        return result.exit_code;
    }
  }
}

}  // namespace
}  // namespace fsdp::launch

/// Parses the command line and runs the job; see usage_text() for behaviour.
int main(int argc, char** argv) {
  using fsdp::launch::ParseResult;
  const ParseResult parsed = fsdp::launch::parse_options(
      std::vector<std::string>(argv + 1, argv + argc), fsdp::launch::environment_from(environ));
  switch (parsed.kind) {
    case ParseResult::Kind::kHelp:
      std::cout << fsdp::launch::usage_text();
      return 0;
    case ParseResult::Kind::kError:
      std::cerr << "fsdprun: error: " << parsed.error << "\nRun 'fsdprun --help' for usage.\n";
      return fsdp::launch::kUsageExitCode;
    case ParseResult::Kind::kRun:
      break;
  }
  for (const std::string& warning : parsed.warnings) std::cerr << "fsdprun: " << warning << "\n";
  return fsdp::launch::launch(parsed.options);
}
