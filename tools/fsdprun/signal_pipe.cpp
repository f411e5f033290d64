#include "signal_pipe.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace fsdp::launch {
namespace {

// Handlers may only touch lock-free, signal-safe state.
volatile sig_atomic_t g_write_fd = -1;
volatile sig_atomic_t g_first_signal = 0;
volatile sig_atomic_t g_last_signal = 0;
volatile sig_atomic_t g_signal_count = 0;

/// Records termination signals and wakes the main loop. errno is preserved
/// because the interrupted code may be inspecting it.
void on_signal(int signo) {
  const int saved_errno = errno;
  if (signo != SIGCHLD) {
    if (g_first_signal == 0) g_first_signal = signo;
    g_last_signal = signo;
    g_signal_count = g_signal_count + 1;
  }
  const char byte = static_cast<char>(signo);
  // Non-blocking: if the pipe is full the loop is already due to wake up.
  if (g_write_fd >= 0) (void)!::write(g_write_fd, &byte, 1);
  errno = saved_errno;
}

/// Throws the current errno as std::system_error.
[[noreturn]] void throw_errno(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

}  // namespace

SignalPipe::SignalPipe(const std::vector<int>& termination) : handled_(termination) {
  handled_.push_back(SIGCHLD);
  handled_.push_back(SIGPIPE);
  saved_.resize(handled_.size());
  installed_.assign(handled_.size(), 0);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) throw_errno("pipe2");
  read_fd_ = fds[0];
  write_fd_ = fds[1];
  g_write_fd = write_fd_;
  g_first_signal = 0;
  g_last_signal = 0;
  g_signal_count = 0;

  for (size_t i = 0; i < handled_.size(); ++i) {
    const int signo = handled_[i];
    if (::sigaction(signo, nullptr, &saved_[i]) != 0) throw_errno("sigaction");
    const bool inherited_ignore = saved_[i].sa_handler == SIG_IGN;
    if (inherited_ignore && (signo == SIGINT || signo == SIGHUP || signo == SIGQUIT)) continue;
    struct sigaction action {};
    sigemptyset(&action.sa_mask);
    if (signo == SIGPIPE) {
      action.sa_handler = SIG_IGN;
    } else {
      action.sa_handler = on_signal;
      // SA_RESTART keeps blocking writes to our stdout from failing with
      // EINTR; poll() is interrupted regardless, which is what wakes us.
      action.sa_flags = SA_RESTART | (signo == SIGCHLD ? SA_NOCLDSTOP : 0);
    }
    if (::sigaction(signo, &action, nullptr) != 0) throw_errno("sigaction");
    installed_[i] = 1;
  }
}

SignalPipe::~SignalPipe() {
  for (size_t i = 0; i < handled_.size(); ++i) {
    if (installed_[i] != 0) ::sigaction(handled_[i], &saved_[i], nullptr);
  }
  g_write_fd = -1;
  ::close(read_fd_);
  ::close(write_fd_);
}

void SignalPipe::drain() const {
  char buffer[64];
  while (::read(read_fd_, buffer, sizeof(buffer)) > 0) {
  }
}

int SignalPipe::first_termination_signal() const { return g_first_signal; }

int SignalPipe::last_termination_signal() const { return g_last_signal; }

int SignalPipe::termination_count() const { return g_signal_count; }

void SignalPipe::restore_in_child() const {
  for (size_t i = 0; i < handled_.size(); ++i) {
    if (installed_[i] != 0) ::sigaction(handled_[i], &saved_[i], nullptr);
  }
}

}  // namespace fsdp::launch
