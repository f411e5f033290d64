#include "rendezvous/tcp_store.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <algorithm>
#include <sstream>

#include "detail/error.h"
#include "rendezvous/job_token.h"
#include "rendezvous/socket.h"
#include "rendezvous/store_protocol.h"
#include "rendezvous/store_server.h"

// Note [Rendezvous store]
// Rank 0 runs the store's server; every rank (rank 0 too) talks to it through
// one client connection. c10d's TCPStore in LibTorch 1.13 listens on the
// wildcard address (measured: `ss -ltn` shows `*:PORT`), so a job started on a
// laptop would accept connections from the network. TcpStore binds exactly the
// address it is given, by default the one clients dial (MASTER_ADDR: any
// loopback address, IPv6 too). It derives from c10d::Store, so c10d's own
// classes (PrefixStore, ProcessGroupGloo) use it.
// Every request has a deadline (the store's timeout, plus the server-side wait
// of a get or wait), so a server that accepts but never answers, or a rank 0
// that stopped, is an error naming the store's address, not a hang. A request
// that failed leaves the stream out of step, so the connection is closed and
// later requests fail at once with the first cause.
// A new connection sends the job token's handshake at once and reads the
// server's answer with its first reply, so the check costs no round trip of
// its own; a server that closes the connection before answering refused the
// token (Note [Job token]).

namespace fsdp {

using detail::MessageReader;
using detail::MessageWriter;
using detail::StoreCommand;
using detail::StoreStatus;

namespace {

// A request of `bytes` (or of at least that many) is refused before it is
// built or sent.
void check_request_size(size_t bytes, const std::string& address) {
  FSDP_CHECK(bytes <= detail::kMaxStoreMessage, -1, "tcp store", "a request of ", bytes,
             " bytes to the rendezvous store at ", address, " is over its limit of ",
             detail::kMaxStoreMessage,
             " bytes. Keep store values small; send tensors through the process group.");
}

std::string join_keys(const std::vector<std::string>& keys) {
  std::ostringstream os;
  for (size_t i = 0; i < keys.size(); ++i) os << (i ? ", " : "") << keys[i];
  return os.str();
}

using Clock = std::chrono::steady_clock;
constexpr auto kForever = std::chrono::milliseconds::max();
constexpr auto kAnswerSlack = std::chrono::milliseconds(2000);

detail::IoResult send_message(int fd, const std::vector<uint8_t>& message,
                              Clock::time_point deadline) {
  const auto len = static_cast<uint32_t>(message.size());
  auto r = detail::write_all_until(fd, &len, sizeof(len), deadline);
  return r == detail::IoResult::kOk
             ? detail::write_all_until(fd, message.data(), message.size(), deadline)
             : r;
}

detail::IoResult recv_message(int fd, std::vector<uint8_t>* message, Clock::time_point deadline) {
  uint32_t len = 0;
  auto r = detail::read_all_until(fd, &len, sizeof(len), deadline);
  if (r != detail::IoResult::kOk) return r;
  if (len > detail::kMaxStoreMessage) return detail::IoResult::kClosed;
  message->resize(len);
  return detail::read_all_until(fd, message->data(), len, deadline);
}

}  // namespace

TcpStore::TcpStore(const std::string& host, int port, bool is_server,
                   std::chrono::milliseconds timeout, const std::string& listen_addr,
                   const std::optional<std::string>& job_token)
    : c10d::Store(timeout),
      host_(host),
      port_(port),
      job_token_(detail::resolve_job_token(job_token.value_or(""))) {
  FSDP_CHECK(port >= 0 && port <= 65535, -1, "tcp store", "port must be in [0, 65535], got ", port);
  if (is_server) {
    server_ = std::make_unique<detail::StoreServer>(listen_addr.empty() ? host : listen_addr, port,
                                                    job_token_);
    port_ = server_->port();
  } else {
    FSDP_CHECK(port > 0, -1, "tcp store", "a client needs the server's port, got 0");
  }
  detail::UniqueFd fd = detail::connect_tcp(host_, port_, timeout);
  // A fresh socket's buffer takes the few bytes at once; a failure here means
  // the peer is already gone, which the first request reports.
  detail::send_handshake(fd.get(), job_token_, detail::deadline_after(timeout));
  fd_ = fd.release();
}

c10::intrusive_ptr<c10d::Store> TcpStore::clone() {
  return c10::make_intrusive<TcpStore>(host_, port_, false, timeout_, "", job_token_);
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  server_.reset();
}

std::string TcpStore::address() const {
  const bool v6 = host_.find(':') != std::string::npos;
  return (v6 ? "[" + host_ + "]" : host_) + ":" + std::to_string(port_);
}

std::vector<uint8_t> TcpStore::request(const std::vector<uint8_t>& message,
                                       std::chrono::milliseconds server_wait) {
  std::lock_guard<std::mutex> lock(mutex_);
  FSDP_CHECK(fd_ >= 0, -1, "tcp store", "the connection to the rendezvous store at ", address(),
             " was closed after an earlier request failed: ", broken_);
  // No limit when the store's timeout is c10d's kNoTimeout (zero), or the
  // server may hold the request forever. A request the server holds gets 2 s
  // more than the server's wait, so that its own "timed out waiting for key"
  // reply (which names the key) arrives first even on a loaded machine.
  check_request_size(message.size(), address());
  const bool unlimited = timeout_.count() <= 0 || server_wait >= kForever - kAnswerSlack;
  // Added only when limited: the server's wait of milliseconds::max() plus
  // the slack would overflow.
  const auto limit = unlimited                 ? kForever
                     : server_wait.count() > 0 ? server_wait + kAnswerSlack
                                               : timeout_;
  const auto deadline = unlimited ? Clock::time_point::max() : detail::deadline_after(limit);
  std::vector<uint8_t> reply;
  auto result = send_message(fd_, message, deadline);
  bool refused = false;
  if (!accepted_) {  // the answer to the handshake, read even after a failed send: it says why
    const auto answer = detail::read_handshake_answer(fd_, deadline);
    accepted_ = answer == detail::HandshakeAnswer::kAccepted;
    refused = answer == detail::HandshakeAnswer::kRefused;
    if (result == detail::IoResult::kOk && !accepted_) {
      result = answer == detail::HandshakeAnswer::kTimedOut ? detail::IoResult::kTimedOut
                                                            : detail::IoResult::kClosed;
    }
  }
  if (result == detail::IoResult::kOk) result = recv_message(fd_, &reply, deadline);
  if (result != detail::IoResult::kOk) {
    broken_ =
        refused
            ? "the rendezvous store at " + address() +
                  " refused this rank's job token: FSDP_JOB_TOKEN differs from the job's. Start "
                  "every rank with the same FSDP_JOB_TOKEN (fsdprun sets one per job; on several "
                  "nodes export the same value on each), or MASTER_ADDR/MASTER_PORT name another "
                  "job's store."
        : result == detail::IoResult::kTimedOut
            ? "the store at " + address() + " did not answer within " +
                  std::to_string(limit.count()) +
                  " ms. Rank 0 (which serves it) is stuck, or MASTER_ADDR/MASTER_PORT "
                  "name something that is not this job's rendezvous store."
            : "lost the connection to the rendezvous store at " + address() +
                  ". Rank 0 (which serves it) has probably exited or crashed; look at its "
                  "output.";
    ::close(fd_);
    fd_ = -1;
    FSDP_FAIL(-1, "tcp store", broken_);
  }
  FSDP_CHECK(!reply.empty() && reply[0] != static_cast<uint8_t>(StoreStatus::kBadRequest), -1,
             "tcp store", "the store at ", address(), " rejected a request");
  return reply;
}

void TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  // Before the message is built: a value over the limit is not copied (1 GiB
  // took 47 s to copy under ThreadSanitizer).
  check_request_size(key.size() + value.size(), address());
  MessageWriter w;
  w.u8(static_cast<uint8_t>(StoreCommand::kSet)).str(key).vec(value);
  request(w.get());
}

std::vector<uint8_t> TcpStore::compareSet(const std::string& key,
                                          const std::vector<uint8_t>& expected,
                                          const std::vector<uint8_t>& desired) {
  MessageWriter w;
  w.u8(static_cast<uint8_t>(StoreCommand::kCompareSet)).str(key).vec(expected).vec(desired);
  auto reply = request(w.get());
  MessageReader r(reply);
  r.u8();
  return r.vec();
}

std::vector<uint8_t> TcpStore::get(const std::string& key) {
  MessageWriter w;
  w.u8(static_cast<uint8_t>(StoreCommand::kGet)).str(key).i64(timeout_.count());
  auto reply = request(w.get(), timeout_.count() > 0 ? timeout_ : kForever);
  MessageReader r(reply);
  FSDP_CHECK(r.u8() == static_cast<uint8_t>(StoreStatus::kOk), -1, "tcp store", "timed out after ",
             timeout_.count(), " ms waiting for key '", key, "' at ", address(),
             ". Some rank has not reached this point: is every one of the WORLD_SIZE ranks "
             "started, and do they all run the same program?");
  return r.vec();
}

int64_t TcpStore::add(const std::string& key, int64_t value) {
  MessageWriter w;
  w.u8(static_cast<uint8_t>(StoreCommand::kAdd)).str(key).i64(value);
  auto reply = request(w.get());
  MessageReader r(reply);
  r.u8();
  return r.i64();
}

bool TcpStore::deleteKey(const std::string& key) {
  MessageWriter w;
  w.u8(static_cast<uint8_t>(StoreCommand::kDelete)).str(key);
  auto reply = request(w.get());
  MessageReader r(reply);
  r.u8();
  return r.u8() != 0;
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  MessageWriter w;
  w.u8(static_cast<uint8_t>(StoreCommand::kCheck)).i64(static_cast<int64_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  auto reply = request(w.get());
  MessageReader r(reply);
  r.u8();
  return r.u8() != 0;
}

int64_t TcpStore::getNumKeys() {
  MessageWriter w;
  w.u8(static_cast<uint8_t>(StoreCommand::kNumKeys));
  auto reply = request(w.get());
  MessageReader r(reply);
  r.u8();
  return r.i64();
}

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TcpStore::wait(const std::vector<std::string>& keys,
                    const std::chrono::milliseconds& timeout) {
  MessageWriter w;
  w.u8(static_cast<uint8_t>(StoreCommand::kWait))
      .i64(timeout.count())
      .i64(static_cast<int64_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  auto reply = request(w.get(), timeout.count() > 0 ? timeout : kForever);
  FSDP_CHECK(reply[0] == static_cast<uint8_t>(StoreStatus::kOk), -1, "tcp store",
             "timed out after ", timeout.count(), " ms waiting for keys [", join_keys(keys),
             "] at ", address(), ". Some rank has not reached this point.");
}

}  // namespace fsdp
