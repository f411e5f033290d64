#include "comm/store_server.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "comm/store_protocol.h"

namespace fsdp::detail {

bool send_message(int fd, const std::vector<uint8_t>& message) {
  const auto len = static_cast<uint32_t>(message.size());
  return write_all(fd, &len, sizeof(len)) && write_all(fd, message.data(), message.size());
}

bool recv_message(int fd, std::vector<uint8_t>* message) {
  uint32_t len = 0;
  if (!read_all(fd, &len, sizeof(len)) || len > kMaxStoreMessage) return false;
  message->resize(len);
  return read_all(fd, message->data(), len);
}

StoreServer::StoreServer(const std::string& listen_addr, int port) {
  listen_fd_ = listen_tcp(listen_addr, port, &port_);
  accept_thread_ = std::thread([this] { accept_loop(); });
}

StoreServer::~StoreServer() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    // shutdown() wakes threads blocked in accept()/recv() on these sockets.
    ::shutdown(listen_fd_.get(), SHUT_RDWR);
    for (int fd : client_fds_) ::shutdown(fd, SHUT_RDWR);
  }
  changed_.notify_all();
  accept_thread_.join();
  // No new client threads can start once accept_loop has returned.
  for (auto& t : client_threads_) t.join();
}

void StoreServer::accept_loop() {
  while (true) {
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      if (fd >= 0) ::close(fd);
      return;
    }
    if (fd < 0) continue;
    client_fds_.push_back(fd);
    client_threads_.emplace_back([this, fd] { serve(fd); });
  }
}

void StoreServer::serve(int fd) {
  std::vector<uint8_t> request;
  while (recv_message(fd, &request)) {
    std::vector<uint8_t> reply;
    try {
      reply = handle(request);
    } catch (const std::exception&) {
      reply = {static_cast<uint8_t>(StoreStatus::kBadRequest)};
    }
    if (!send_message(fd, reply)) break;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  client_fds_.erase(std::remove(client_fds_.begin(), client_fds_.end(), fd), client_fds_.end());
  ::close(fd);
}

bool StoreServer::wait_for_keys(std::unique_lock<std::mutex>& lock,
                                const std::vector<std::string>& keys, int64_t timeout_ms) {
  auto present = [&] {
    return stopping_ || std::all_of(keys.begin(), keys.end(),
                                    [&](const std::string& k) { return data_.count(k) > 0; });
  };
  if (timeout_ms <= 0) {  // c10d's kNoTimeout: wait without limit
    changed_.wait(lock, present);
  } else {
    changed_.wait_for(lock, std::chrono::milliseconds(timeout_ms), present);
  }
  return !stopping_ && present();
}

std::vector<uint8_t> StoreServer::handle(const std::vector<uint8_t>& request) {
  MessageReader in(request);
  MessageWriter out;
  const auto command = static_cast<StoreCommand>(in.u8());
  std::unique_lock<std::mutex> lock(mutex_);
  switch (command) {
    case StoreCommand::kSet: {
      std::string key = in.str();
      data_[key] = in.vec();
      changed_.notify_all();
      out.u8(static_cast<uint8_t>(StoreStatus::kOk));
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
        changed_.notify_all();
      }
      out.u8(static_cast<uint8_t>(StoreStatus::kOk)).vec(data_.count(key) ? data_[key] : expected);
      break;
    }
    case StoreCommand::kGet: {
      std::string key = in.str();
      const int64_t timeout_ms = in.i64();
      if (!wait_for_keys(lock, {key}, timeout_ms)) {
        out.u8(static_cast<uint8_t>(StoreStatus::kTimeout));
      } else {
        out.u8(static_cast<uint8_t>(StoreStatus::kOk)).vec(data_[key]);
      }
      break;
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
      changed_.notify_all();
      out.u8(static_cast<uint8_t>(StoreStatus::kOk)).i64(value);
      break;
    }
    case StoreCommand::kDelete: {
      const bool erased = data_.erase(in.str()) > 0;
      out.u8(static_cast<uint8_t>(StoreStatus::kOk)).u8(erased ? 1 : 0);
      break;
    }
    case StoreCommand::kCheck: {
      const int64_t n = in.i64();
      bool all = true;
      for (int64_t i = 0; i < n; ++i) all = data_.count(in.str()) > 0 && all;
      out.u8(static_cast<uint8_t>(StoreStatus::kOk)).u8(all ? 1 : 0);
      break;
    }
    case StoreCommand::kNumKeys:
      out.u8(static_cast<uint8_t>(StoreStatus::kOk)).i64(static_cast<int64_t>(data_.size()));
      break;
    case StoreCommand::kWait: {
      const int64_t timeout_ms = in.i64();
      const int64_t n = in.i64();
      std::vector<std::string> keys;
      for (int64_t i = 0; i < n; ++i) keys.push_back(in.str());
      const bool ok = wait_for_keys(lock, keys, timeout_ms);
      out.u8(static_cast<uint8_t>(ok ? StoreStatus::kOk : StoreStatus::kTimeout));
      break;
    }
    default:
      out.u8(static_cast<uint8_t>(StoreStatus::kBadRequest));
  }
  return std::move(out.get());
}

}  // namespace fsdp::detail
