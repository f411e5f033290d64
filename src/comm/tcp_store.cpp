#include <fsdp/comm/tcp_store.h>

#include <c10/util/Exception.h>

#include <unistd.h>

#include <sstream>

#include "comm/socket.h"
#include "comm/store_protocol.h"
#include "comm/store_server.h"

// Note [Rendezvous store]
// Rank 0 runs the store's server; every rank (rank 0 too) talks to it through
// one client connection. c10d's TCPStore in LibTorch 1.13 listens on the
// wildcard address (measured: `ss -ltn` shows `*:PORT`), so a job started on a
// laptop would accept connections from the network. TcpStore binds exactly the
// address it is given, loopback unless the job spans nodes. It derives from
// c10d::Store, so c10d's own classes (PrefixStore, ProcessGroupGloo) use it.

namespace fsdp {

using detail::MessageReader;
using detail::MessageWriter;
using detail::StoreCommand;
using detail::StoreStatus;

namespace {

std::string join_keys(const std::vector<std::string>& keys) {
  std::ostringstream os;
  for (size_t i = 0; i < keys.size(); ++i) os << (i ? ", " : "") << keys[i];
  return os.str();
}

}  // namespace

TcpStore::TcpStore(const std::string& host, int port, bool is_server,
                   std::chrono::milliseconds timeout, const std::string& listen_addr)
    : c10d::Store(timeout), host_(host), port_(port) {
  TORCH_CHECK(port >= 0 && port <= 65535, "fsdp::TcpStore: port must be in [0, 65535], got ", port);
  if (is_server) {
    server_ = std::make_unique<detail::StoreServer>(listen_addr, port);
    port_ = server_->port();
  } else {
    TORCH_CHECK(port > 0, "fsdp::TcpStore: a client needs the server's port, got 0");
  }
  fd_ = detail::connect_tcp(host_, port_, timeout).release();
}

c10::intrusive_ptr<c10d::Store> TcpStore::clone() {
  return c10::make_intrusive<TcpStore>(host_, port_, false, timeout_);
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  server_.reset();
}

std::vector<uint8_t> TcpStore::request(const std::vector<uint8_t>& message) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<uint8_t> reply;
  TORCH_CHECK(detail::send_message(fd_, message) && detail::recv_message(fd_, &reply),
              "fsdp::TcpStore: lost the connection to the rendezvous store at ", host_, ":", port_,
              ". Rank 0 (which serves it) has probably exited or crashed; look at its output.");
  TORCH_CHECK(!reply.empty() && reply[0] != static_cast<uint8_t>(StoreStatus::kBadRequest),
              "fsdp::TcpStore: the store at ", host_, ":", port_, " rejected a request");
  return reply;
}

void TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
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
  auto reply = request(w.get());
  MessageReader r(reply);
  TORCH_CHECK(r.u8() == static_cast<uint8_t>(StoreStatus::kOk), "fsdp::TcpStore: timed out after ",
              timeout_.count(), " ms waiting for key '", key, "' at ", host_, ":", port_,
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
  auto reply = request(w.get());
  TORCH_CHECK(reply[0] == static_cast<uint8_t>(StoreStatus::kOk),
              "fsdp::TcpStore: timed out after ", timeout.count(), " ms waiting for keys [",
              join_keys(keys), "] at ", host_, ":", port_,
              ". Some rank has not reached this point.");
}

}  // namespace fsdp
