#include "rendezvous/store_server.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "detail/error.h"
#include "rendezvous/store_protocol.h"

// Note [Store server]
// The rendezvous store is reachable by anything that can reach its address (a
// port scanner, a health check, another host on a multi-node job), so it must
// survive any number of connections that send nothing, garbage, or close at
// once. It used to run a joinable thread per connection: 3000 probes grew rank
// 0 by 340 MB, and when a thread could not be created std::terminate ended
// the job. Now one thread polls the listening socket and every connection
// (non-blocking), so a connection costs a map entry and its buffers, freed
// when it closes:
// - Requests on a connection are served one at a time: while a reply is
//   unsent or a get/wait is parked, nothing more is read from it (TCP flow
//   control holds back a client that pipelines), so a client's buffers stay
//   bounded by one request and one reply.
// - A get/wait whose keys are missing is parked with its deadline; every turn
//   of the loop answers the parked requests whose keys arrived or whose
//   deadline passed, and poll() sleeps until the nearest deadline.
// - A frame longer than kMaxStoreMessage, bytes sent while a request is
//   parked, or EOF close the connection; a request that does not parse gets
//   kBadRequest. Nothing a peer sends can throw out of the loop.
// - At most kMaxConnections connections: beyond it (or when the process is
//   out of descriptors) the oldest connection that never sent a whole request
//   is closed; a rank's own connection speaks first thing, so it is never it.
// - A connection starts in Phase::kHandshake: it must present the job token
//   (Note [Job token]) within kHandshakeTimeout or it is closed, counted and
//   (the first time) logged; only then are its bytes read as requests.

namespace fsdp::detail {

namespace {

constexpr size_t kReadChunk = 64 << 10;
constexpr auto kAcceptPause = std::chrono::milliseconds(100);

uint8_t status_byte(StoreStatus s) { return static_cast<uint8_t>(s); }

std::vector<uint8_t> framed(std::vector<uint8_t> body) {
  const auto len = static_cast<uint32_t>(body.size());
  const auto* p = reinterpret_cast<const uint8_t*>(&len);
  body.insert(body.begin(), p, p + sizeof(len));
  return body;
}

}  // namespace

StoreServer::StoreServer(const std::string& listen_addr, int port, std::string job_token)
    : job_token_(std::move(job_token)) {
  listen_fd_ = listen_tcp(listen_addr, port, &port_);
  ::fcntl(listen_fd_.get(), F_SETFL, ::fcntl(listen_fd_.get(), F_GETFL) | O_NONBLOCK);
  wake_fd_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  FSDP_CHECK(wake_fd_.get() >= 0, -1, "tcp store", "eventfd failed: ", std::strerror(errno));
  loop_ = std::thread([this] { run(); });
}

StoreServer::~StoreServer() {
  const uint64_t one = 1;
  while (::write(wake_fd_.get(), &one, sizeof(one)) < 0 && errno == EINTR) {
  }
  loop_.join();
}

void StoreServer::run() {
  std::vector<pollfd> fds;
  while (true) {
    const auto now = Clock::now();
    const bool accepting = now >= accept_paused_until_;
    fds.clear();
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    fds.push_back({accepting ? listen_fd_.get() : -1, POLLIN, 0});  // poll skips fd -1
    for (const auto& [fd, c] : connections_) {
      fds.push_back({fd, static_cast<short>(c.out_at < c.out.size() ? POLLOUT : POLLIN), 0});
    }
    auto until = next_deadline();
    if (!accepting) until = std::min(until, accept_paused_until_);
    int timeout_ms = -1;
    if (until != Clock::time_point::max()) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - now).count();
      timeout_ms = static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // never spin on a poll error
    }
    if (fds[0].revents != 0) return;
    // Connections first: accepting may close one (make_room) and reuse its fd.
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      auto it = connections_.find(fds[i].fd);
      if (it == connections_.end()) continue;
      bool keep = (fds[i].revents & (POLLERR | POLLNVAL)) == 0;
      try {
        if (keep && (fds[i].events & POLLOUT)) keep = write_to(it->second);
        if (keep && (fds[i].events & POLLIN)) keep = read_from(it->second);
        if (keep) keep = serve_requests(it->second);
      } catch (const std::exception&) {
        keep = false;  // e.g. out of memory for one peer's buffers: drop that peer
      }
      if (!keep) connections_.erase(it);
    }
    const auto after = Clock::now();
    if (fds[1].revents != 0) accept_new(after);
    close_slow_handshakes(after);
    answer_parked(after);
  }
}

void StoreServer::accept_new(Clock::time_point now) {
  while (true) {
    const int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        if (make_room()) continue;
        accept_paused_until_ = now + kAcceptPause;  // the backlog waits; no busy loop
      }
      return;  // EAGAIN: no more pending connections
    }
    UniqueFd owned(fd);
    if (connections_.size() >= kMaxConnections && !make_room()) continue;  // refuses this one
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    try {
      Connection& c = connections_[fd];
      c.fd = std::move(owned);
      c.serial = accepted_++;
      c.handshake_until = now + kHandshakeTimeout;
    } catch (const std::exception&) {
      connections_.erase(fd);
    }
  }
}

bool StoreServer::make_room() {
  auto victim = connections_.end();
  for (auto it = connections_.begin(); it != connections_.end(); ++it) {
    if (!it->second.spoke &&
        (victim == connections_.end() || it->second.serial < victim->second.serial)) {
      victim = it;
    }
  }
  if (victim == connections_.end()) return false;
  connections_.erase(victim);
  return true;
}

bool StoreServer::read_handshake(Connection& c) {
  switch (c.handshake.read_some(c.fd.get(), job_token_)) {
    case HandshakeReader::State::kReading:
      return true;
    case HandshakeReader::State::kRefused:
      record_refusal(c.fd.get(), -1, "the rendezvous store", c.handshake.refusal());
      return false;
    case HandshakeReader::State::kAccepted:
      break;
  }
  c.phase = Phase::kServing;
  c.handshake = HandshakeReader();
  const auto ack = handshake_ack_bytes();
  c.out.assign(ack.begin(), ack.end());
  c.out_at = 0;
  return write_to(c);
}

void StoreServer::close_slow_handshakes(Clock::time_point now) {
  for (auto it = connections_.begin(); it != connections_.end();) {
    const Connection& c = it->second;
    if (c.phase == Phase::kHandshake && now >= c.handshake_until) {
      record_refusal(c.fd.get(), -1, "the rendezvous store",
                     "it sent no complete handshake within 5 s");
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

bool StoreServer::read_from(Connection& c) {
  if (c.phase == Phase::kHandshake && !read_handshake(c)) return false;
  if (c.phase == Phase::kHandshake) return true;  // the rest of the handshake is yet to come
  uint8_t buf[kReadChunk];
  while (true) {
    const ssize_t r = ::recv(c.fd.get(), buf, sizeof(buf), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    // EOF, an error, or bytes while a request is parked (a client waits for
    // its reply before sending more): either way the connection is done.
    if (r <= 0 || c.parked) return false;
    c.in.insert(c.in.end(), buf, buf + r);
    if (c.in.size() > sizeof(uint32_t) + kMaxStoreMessage) return false;
  }
}

bool StoreServer::write_to(Connection& c) {
  while (c.out_at < c.out.size()) {
    const ssize_t w =
        ::send(c.fd.get(), c.out.data() + c.out_at, c.out.size() - c.out_at, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (w <= 0) return false;
    c.out_at += static_cast<size_t>(w);
  }
  c.out.clear();
  c.out.shrink_to_fit();  // a large reply's buffer is not kept per connection
  c.out_at = 0;
  return true;
}

bool StoreServer::serve_requests(Connection& c) {
  while (!c.parked && c.out.empty() && c.in.size() >= sizeof(uint32_t)) {
    uint32_t len = 0;
    std::memcpy(&len, c.in.data(), sizeof(len));
    if (len > kMaxStoreMessage) return false;
    if (c.in.size() < sizeof(len) + len) break;
    const std::vector<uint8_t> request(c.in.begin() + sizeof(len),
                                       c.in.begin() + sizeof(len) + len);
    c.in.erase(c.in.begin(), c.in.begin() + sizeof(len) + len);
    c.spoke = true;
    try {
      handle(c, request);
    } catch (const std::exception&) {  // a short message, or c10d's add on a non-number
      reply(c, {status_byte(StoreStatus::kBadRequest)});
    }
    if (!write_to(c)) return false;
  }
  if (c.in.empty()) c.in.shrink_to_fit();
  return true;
}

void StoreServer::reply(Connection& c, std::vector<uint8_t> message) {
  c.out = framed(std::move(message));
  c.out_at = 0;
}

bool StoreServer::present(const std::vector<std::string>& keys) const {
  return std::all_of(keys.begin(), keys.end(),
                     [&](const std::string& k) { return data_.count(k) > 0; });
}

StoreServer::Clock::time_point StoreServer::next_deadline() const {
  auto until = Clock::time_point::max();
  for (const auto& [fd, c] : connections_) {
    if (c.parked) until = std::min(until, c.parked->deadline);
    if (c.phase == Phase::kHandshake) until = std::min(until, c.handshake_until);
  }
  return until;
}

void StoreServer::answer_parked(Clock::time_point now) {
  for (auto it = connections_.begin(); it != connections_.end();) {
    Connection& c = it->second;
    bool keep = true;
    if (c.parked && (present(c.parked->keys) || now >= c.parked->deadline)) {
      MessageWriter out;
      if (!present(c.parked->keys)) {
        out.u8(status_byte(StoreStatus::kTimeout));
      } else {
        out.u8(status_byte(StoreStatus::kOk));
        if (c.parked->is_get) out.vec(data_.at(c.parked->keys[0]));
      }
      c.parked.reset();
      reply(c, std::move(out.get()));
      keep = write_to(c) && serve_requests(c);
    }
    it = keep ? std::next(it) : connections_.erase(it);
  }
}

void StoreServer::handle(Connection& c, const std::vector<uint8_t>& request) {
  MessageReader in(request);
  MessageWriter out;
  const auto command = static_cast<StoreCommand>(in.u8());
  // A get or wait parks the connection until its keys exist or time runs out.
  auto park = [&](bool is_get, std::vector<std::string> keys, int64_t timeout_ms) {
    Parked p{is_get, std::move(keys), Clock::time_point::max()};
    if (timeout_ms > 0) p.deadline = deadline_after(std::chrono::milliseconds(timeout_ms));
    c.parked = std::move(p);  // answered (at once if the keys exist) by answer_parked
  };
  switch (command) {
    case StoreCommand::kSet: {
      std::string key = in.str();
      data_[key] = in.vec();
      out.u8(status_byte(StoreStatus::kOk));
      break;
    }
    case StoreCommand::kCompareSet: {
      std::string key = in.str();
      auto expected = in.vec();
      auto desired = in.vec();
      auto it = data_.find(key);
      if ((it == data_.end() && expected.empty()) ||
          (it != data_.end() && it->second == expected)) {
        data_[key] = desired;
      }
      it = data_.find(key);
      out.u8(status_byte(StoreStatus::kOk)).vec(it != data_.end() ? it->second : expected);
      break;
    }
    case StoreCommand::kGet: {
      std::string key = in.str();
      const int64_t timeout_ms = in.i64();
      return park(true, {std::move(key)}, timeout_ms);
    }
    case StoreCommand::kAdd: {
      std::string key = in.str();
      const int64_t delta = in.i64();
      int64_t value = 0;
      auto it = data_.find(key);
      if (it != data_.end()) value = std::stoll(std::string(it->second.begin(), it->second.end()));
      value += delta;
      const std::string text = std::to_string(value);  // c10d stores counters as text
      data_[key] = std::vector<uint8_t>(text.begin(), text.end());
      out.u8(status_byte(StoreStatus::kOk)).i64(value);
      break;
    }
    case StoreCommand::kDelete: {
      const bool erased = data_.erase(in.str()) > 0;
      out.u8(status_byte(StoreStatus::kOk)).u8(erased ? 1 : 0);
      break;
    }
    case StoreCommand::kCheck: {
      const int64_t n = in.i64();
      bool all = true;
      for (int64_t i = 0; i < n; ++i) all = data_.count(in.str()) > 0 && all;
      out.u8(status_byte(StoreStatus::kOk)).u8(all ? 1 : 0);
      break;
    }
    case StoreCommand::kNumKeys:
      out.u8(status_byte(StoreStatus::kOk)).i64(static_cast<int64_t>(data_.size()));
      break;
    case StoreCommand::kWait: {
      const int64_t timeout_ms = in.i64();
      const int64_t n = in.i64();
      std::vector<std::string> keys;
      for (int64_t i = 0; i < n; ++i) keys.push_back(in.str());
      return park(false, std::move(keys), timeout_ms);
    }
    default:
      out.u8(status_byte(StoreStatus::kBadRequest));
  }
  reply(c, std::move(out.get()));
}

}  // namespace fsdp::detail
