#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/socket.h"

namespace fsdp::detail {

/// The key-value server behind TcpStore: one accept thread and one thread per
/// connection (a job has one connection per rank, so threads stay few).
/// Blocking requests (get, wait) wait on a condition variable with the
/// client's timeout.
class StoreServer {
 public:
  /// Listens on listen_addr:port (0: any free port).
  StoreServer(const std::string& listen_addr, int port);
  /// Stops accepting, closes every connection and joins all threads.
  ~StoreServer();

  /// The bound port.
  int port() const { return port_; }

 private:
  void accept_loop();
  void serve(int fd);
  std::vector<uint8_t> handle(const std::vector<uint8_t>& request);
  bool wait_for_keys(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                     int64_t timeout_ms);

  // Constant after construction.
  UniqueFd listen_fd_;
  int port_ = 0;

  // State below is protected by mutex_.
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::vector<uint8_t>> data_;
  std::vector<int> client_fds_;
  std::vector<std::thread> client_threads_;
  bool stopping_ = false;

  std::thread accept_thread_;
};

}  // namespace fsdp::detail
