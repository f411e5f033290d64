#include "exit_status.h"

#include <signal.h>
#include <sys/wait.h>

namespace fsdp::launch {
namespace {

/// A signal number and its name.
struct SignalName {
  int signo;
  const char* name;
};

// A fixed table rather than sigabbrev_np(): that needs glibc >= 2.32, and
// these are the signals that actually end ranks or that fsdprun forwards.
constexpr SignalName kSignalNames[] = {
    {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"},     {SIGILL, "SIGILL"},
    {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},       {SIGFPE, "SIGFPE"},
    {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"},     {SIGUSR2, "SIGUSR2"},
    {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"},     {SIGXCPU, "SIGXCPU"},
    {SIGXFSZ, "SIGXFSZ"}, {SIGSYS, "SIGSYS"},   {SIGVTALRM, "SIGVTALRM"}, {SIGPROF, "SIGPROF"},
};

}  // namespace

std::string signal_name(int signo) {
  for (const SignalName& entry : kSignalNames) {
    if (entry.signo == signo) return entry.name;
  }
  return "SIG" + std::to_string(signo);
}

int signal_number(const std::string& name) {
  for (const SignalName& entry : kSignalNames) {
    if (name == entry.name) return entry.signo;
  }
  return 0;
}

std::string describe_wait_status(int wait_status) {
  if (WIFEXITED(wait_status)) {
    return "exited with status " + std::to_string(WEXITSTATUS(wait_status));
  }
  if (WIFSIGNALED(wait_status)) {
    const int signo = WTERMSIG(wait_status);
    std::string text =
        "was killed by signal " + std::to_string(signo) + " (" + signal_name(signo) + ")";
    if (WCOREDUMP(wait_status)) text += ", core dumped";
    return text;
  }
  return "ended with wait status " + std::to_string(wait_status);
}

int exit_code_for(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

bool is_success(int wait_status) { return WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0; }

}  // namespace fsdp::launch
