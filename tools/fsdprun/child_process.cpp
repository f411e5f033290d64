#include "child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

extern char** environ;

namespace fsdp::launch {
namespace {

/// Writes a NUL-terminated string to fd 2, ignoring errors: used between
/// fork and exec, where only async-signal-safe calls are allowed.
void child_write_stderr(const char* text) {
  (void)!::write(STDERR_FILENO, text, std::strlen(text));
}

/// Closes both ends of a pipe (if open).
void close_pipe(int fds[2]) {
  for (int i = 0; i < 2; ++i) {
    if (fds[i] >= 0) ::close(fds[i]);
    fds[i] = -1;
  }
}

/// Runs in the forked child; never returns.
[[noreturn]] void exec_child(pid_t parent, int out_w, int err_w, const sigset_t& original_mask,
                             char** child_argv, char** child_env, const SignalPipe& signals) {
  signals.restore_in_child();
  // Own session, hence own process group (like torchrun's
  // start_new_session=True): forwarding a signal to -pid also reaches the
  // rank's own children; a Ctrl-C on the terminal reaches only fsdprun, which
  // forwards it in a controlled way; and unlike a mere background process
  // group, a rank reading the terminal (say, a debugger prompt) is not
  // stopped by SIGTTIN, which would hang the job unnoticed.
  ::setsid();
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  // If fsdprun died before prctl took effect the signal will never come.
  if (::getppid() != parent) ::_exit(1);

  // main() keeps fds 0-2 open, so the pipe ends are never 1 or 2 themselves
  // and dup2 cannot clobber one with the other. dup2 clears FD_CLOEXEC.
  if (::dup2(out_w, STDOUT_FILENO) < 0 || ::dup2(err_w, STDERR_FILENO) < 0) {
    ::_exit(127);
  }
  // Signals were blocked around fork so no handler of fsdprun's could run
  // here; unblocking now delivers anything pending with the restored
  // dispositions.
  ::sigprocmask(SIG_SETMASK, &original_mask, nullptr);

  environ = child_env;
  ::execvp(child_argv[0], child_argv);
  const int exec_errno = errno;
  child_write_stderr("fsdprun: cannot execute '");
  child_write_stderr(child_argv[0]);
  child_write_stderr("': ");
  child_write_stderr(std::strerror(exec_errno));
  child_write_stderr("\n");
  ::_exit(127);
}

}  // namespace

SpawnedProcess spawn_process(const std::vector<std::string>& argv,
                             const std::vector<std::string>& env, const SignalPipe& signals) {
  // Everything the child needs is built before fork: after fork only
  // async-signal-safe calls are allowed.
  std::vector<char*> child_argv;
  for (const std::string& arg : argv) {
    child_argv.push_back(const_cast<char*>(arg.c_str()));
  }
  child_argv.push_back(nullptr);
  std::vector<char*> child_env;
  for (const std::string& entry : env) {
    child_env.push_back(const_cast<char*>(entry.c_str()));
  }
  child_env.push_back(nullptr);

  int out_pipe[2] = {-1, -1};
  int err_pipe[2] = {-1, -1};
  if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) {
    const int saved = errno;
    close_pipe(out_pipe);
    close_pipe(err_pipe);
    throw std::system_error(saved, std::generic_category(), "pipe2");
  }

  sigset_t all;
  sigset_t original_mask;
  sigfillset(&all);
  ::sigprocmask(SIG_BLOCK, &all, &original_mask);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    exec_child(parent, out_pipe[1], err_pipe[1], original_mask, child_argv.data(), child_env.data(),
               signals);
  }
  const int fork_errno = errno;
  ::sigprocmask(SIG_SETMASK, &original_mask, nullptr);

  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  if (pid < 0) {
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    throw std::system_error(fork_errno, std::generic_category(), "fork");
  }
  ::fcntl(out_pipe[0], F_SETFL, ::fcntl(out_pipe[0], F_GETFL) | O_NONBLOCK);
  ::fcntl(err_pipe[0], F_SETFL, ::fcntl(err_pipe[0], F_GETFL) | O_NONBLOCK);
  return SpawnedProcess{pid, out_pipe[0], err_pipe[0]};
}

}  // namespace fsdp::launch
