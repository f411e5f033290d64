#include "rendezvous/token_accept.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "rendezvous/job_token.h"

namespace fsdp::detail {

namespace {

using Clock = std::chrono::steady_clock;

// Bounds the descriptors a flood can make this side hold during set-up.
constexpr size_t kMaxPending = 256;
constexpr const char* kUnfinished =
    "it had not finished its handshake when this rank stopped accepting";

struct Pending {
  UniqueFd fd;
  HandshakeReader handshake;
  Clock::time_point until;
};

int poll_ms(Clock::time_point now, Clock::time_point until) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - now).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

}  // namespace

UniqueFd accept_with_token(int listen_fd, const std::string& token, Clock::time_point deadline,
                           int64_t rank, const char* listener) {
  ::fcntl(listen_fd, F_SETFL, ::fcntl(listen_fd, F_GETFL) | O_NONBLOCK);
  std::vector<Pending> pending;
  auto refuse = [&](Pending& p, const std::string& why) {
    record_refusal(p.fd.get(), rank, listener, why);
    p.fd.reset();
  };
  UniqueFd accepted;
  std::vector<pollfd> fds;
  while (accepted.get() < 0) {
    const auto now = Clock::now();
    if (now >= deadline) break;
    auto until = deadline;
    fds.assign(1, pollfd{listen_fd, POLLIN, 0});
    for (const auto& p : pending) {
      fds.push_back({p.fd.get(), POLLIN, 0});
      until = std::min(until, p.until);
    }
    if (::poll(fds.data(), fds.size(), poll_ms(now, until)) < 0 && errno != EINTR) break;
    const auto after = Clock::now();
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      if (accepted.get() >= 0) {
        refuse(p, kUnfinished);
      } else if (fds[i + 1].revents != 0 &&
                 p.handshake.read_some(p.fd.get(), token) != HandshakeReader::State::kReading) {
        if (p.handshake.state() == HandshakeReader::State::kAccepted) {
          accepted = std::move(p.fd);
        } else {
          refuse(p, p.handshake.refusal());
        }
      } else if (after >= p.until) {
        refuse(p, "it sent no complete handshake within 5 s");
      }
    }
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [](const Pending& p) { return p.fd.get() < 0; }),
                  pending.end());
    if (accepted.get() >= 0 || fds[0].revents == 0) continue;
    while (true) {
      UniqueFd fd(::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (fd.get() < 0 && errno == EINTR) continue;
      if (fd.get() < 0) break;  // EAGAIN, or out of descriptors: the backlog waits
      Pending p{std::move(fd), HandshakeReader(), after + kHandshakeTimeout};
      if (pending.size() >= kMaxPending) {
        refuse(p, "too many connections were mid-handshake");
        continue;
      }
      // Most often the handshake is already there: no extra turn of poll.
      if (p.handshake.read_some(p.fd.get(), token) == HandshakeReader::State::kAccepted) {
        accepted = std::move(p.fd);
        break;
      }
      if (p.handshake.state() == HandshakeReader::State::kRefused) {
        refuse(p, p.handshake.refusal());
      } else {
        pending.push_back(std::move(p));
      }
    }
  }
  for (auto& p : pending) refuse(p, kUnfinished);
  if (accepted.get() < 0) return accepted;
  ::fcntl(accepted.get(), F_SETFL, ::fcntl(accepted.get(), F_GETFL) & ~O_NONBLOCK);
  if (send_handshake_ack(accepted.get(), deadline) != IoResult::kOk) accepted.reset();
  return accepted;
}

}  // namespace fsdp::detail
