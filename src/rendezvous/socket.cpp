#include "rendezvous/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "detail/error.h"

namespace fsdp::detail {

namespace {

struct AddrInfoList {
  addrinfo* head = nullptr;
  ~AddrInfoList() {
    if (head != nullptr) freeaddrinfo(head);
  }
};

// Resolves host:port into `list`; getaddrinfo's answer (0 on success). An
// empty host is never used: we always bind a named address.
int lookup(const std::string& host, int port, int flags, AddrInfoList* list) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags | AI_NUMERICSERV;
  const std::string service = std::to_string(port);
  return getaddrinfo(host.c_str(), service.c_str(), &hints, &list->head);
}

// lookup() that throws, naming `host`, when it cannot be resolved.
AddrInfoList resolve(const std::string& host, int port, int flags) {
  AddrInfoList list;
  const int rc = lookup(host, port, flags, &list);
  FSDP_CHECK(rc == 0, -1, "network", "cannot resolve address '", host, "': ", gai_strerror(rc),
             ". Give a numeric address or a resolvable host name.");
  return list;
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

using Clock = std::chrono::steady_clock;

// Waits until `fd` has one of `events` (or an error/hang-up, which the next
// call reports); false when `deadline` passes first.
bool wait_ready(int fd, short events, Clock::time_point deadline) {
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) return true;  // let the caller's send/recv report it
  }
}

// Connects `fd` to `ai` unless `deadline` passes first; "" on success, else why not.
std::string connect_until(int fd, const addrinfo* ai, Clock::time_point deadline) {
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int err = ::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 ? 0 : errno;
  if (err == EINPROGRESS) {
    if (!wait_ready(fd, POLLOUT, deadline)) return "connect timed out";
    socklen_t len = sizeof(err);
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  }
  if (err != 0) return std::strerror(err);
  ::fcntl(fd, F_SETFL, flags);
  return "";
}

}  // namespace

UniqueFd listen_tcp(const std::string& addr, int port, int* bound_port) {
  AddrInfoList list = resolve(addr, port, AI_PASSIVE);
  std::string last_error = "no address";
  for (addrinfo* ai = list.head; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (fd.get() < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), 1024) != 0) {
      last_error = std::strerror(errno);
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
    *bound_port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                                 : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    return fd;
  }
  FSDP_FAIL(-1, "network", "cannot listen on ", addr, ":", port, ": ", last_error,
            ". If the port is taken, pick another MASTER_PORT (fsdprun picks a free one "
            "when --master-port is not given).");
}

Clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const auto now = Clock::now();
  const auto room =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now);
  return timeout >= room ? Clock::time_point::max() : now + timeout;
}

UniqueFd connect_tcp(const std::string& host, int port, std::chrono::milliseconds timeout) {
  const auto deadline = deadline_after(timeout);
  auto backoff = std::chrono::milliseconds(5);
  std::string last_error;
  while (true) {
    // A name not resolvable yet (a Kubernetes service whose pod is not up,
    // a resolver's EAI_AGAIN) is tried again until the deadline, as c10d's
    // TCPStore does.
    AddrInfoList list;
    const int rc = lookup(host, port, 0, &list);
    if (rc != 0) last_error = std::string("cannot resolve '") + host + "': " + gai_strerror(rc);
    for (addrinfo* ai = list.head; ai != nullptr; ai = ai->ai_next) {
      UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
      if (fd.get() < 0) continue;
      last_error = connect_until(fd.get(), ai, deadline);
      if (last_error.empty()) {
        set_nodelay(fd.get());
        return fd;
      }
    }
    FSDP_CHECK(std::chrono::steady_clock::now() < deadline, -1, "network",
               "cannot reach the rendezvous ", "store at ", host, ":", port, " within ",
               timeout.count(), " ms (", last_error,
               "). Check that rank 0 is running and that MASTER_ADDR/MASTER_PORT are the same "
               "on every rank.");
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
}

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

namespace {

// Moves `n` bytes with `io` (one non-blocking send or recv returning its
// count), waiting for `events` in between, unless `deadline` passes first.
template <typename Io>
IoResult transfer_until(int fd, size_t n, short events, Clock::time_point deadline, Io&& io) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = io(done);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!wait_ready(fd, events, deadline)) return IoResult::kTimedOut;
      continue;
    }
    if (r <= 0) return IoResult::kClosed;
    done += static_cast<size_t>(r);
  }
  return IoResult::kOk;
}

}  // namespace

IoResult write_all_until(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  return transfer_until(fd, n, POLLOUT, deadline, [&](size_t done) {
    return ::send(fd, p + done, n - done, MSG_NOSIGNAL | MSG_DONTWAIT);
  });
}

IoResult read_all_until(int fd, void* data, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  return transfer_until(fd, n, POLLIN, deadline,
                        [&](size_t done) { return ::recv(fd, p + done, n - done, MSG_DONTWAIT); });
}

std::string local_address_toward(const std::string& host) {
  // A connected UDP socket makes the kernel choose the route and source
  // address without sending anything.
  AddrInfoList list = resolve(host, 9, 0);
  for (addrinfo* ai = list.head; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (fd.get() < 0 || ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) continue;
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) continue;
    char buf[INET6_ADDRSTRLEN] = {0};
    const void* src =
        ss.ss_family == AF_INET6
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&ss)->sin_addr);
    if (inet_ntop(ss.ss_family, src, buf, sizeof(buf)) != nullptr) return buf;
  }
  FSDP_FAIL(-1, "network", "no local interface routes to ", host,
            ". Set ProcessGroupOptions::listen_addr to this node's address.");
}

}  // namespace fsdp::detail
