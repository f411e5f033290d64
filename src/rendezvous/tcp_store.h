#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "detail/torch_compat.h"

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

namespace detail {
class StoreServer;
}  // namespace detail

/// A c10d::Store over TCP whose server listens only on the address it is
/// given (loopback by default). c10d's own TCPStore listens on every
/// interface, which is why libfsdp has this one; see Note [Rendezvous store].
/// Drop-in wherever LibTorch takes a c10d::Store (ProcessGroupGloo, PrefixStore).
class TcpStore : public c10d::Store {
 public:
  /// Connects to host:port; when `is_server`, first starts the server on
  /// listen_addr:port ("": on `host`, the address clients dial; port 0 picks
  /// a free one, see port()). Every request fails (naming host:port) when the
  /// server does not answer within `timeout`, plus the request's own wait for
  /// get() and wait(). Every connection presents `job_token` (nullopt: from
  /// FSDP_JOB_TOKEN, else ""), and the server refuses connections without it
  /// (Note [Job token]); a refused client fails its first request with an
  /// error naming the token mismatch.
  TcpStore(const std::string& host, int port, bool is_server,
           std::chrono::milliseconds timeout = std::chrono::minutes(5),
           const std::string& listen_addr = "",
           const std::optional<std::string>& job_token = std::nullopt);
  ~TcpStore() override;

  /// The port the store is reached on (useful after asking for port 0).
  int port() const { return port_; }

  /// Stores `value` under `key`, waking every waiter on it.
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  /// Sets `key` to `desired` if its value is `expected` (or it is missing and
  /// `expected` is empty); returns the value after the call.
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  /// Waits (up to the timeout) for `key` and returns its value.
  std::vector<uint8_t> get(const std::string& key) override;
  /// Adds `value` to the integer under `key` (0 when missing); returns the sum.
  int64_t add(const std::string& key, int64_t value) override;
  /// Removes `key`; true if it existed.
  bool deleteKey(const std::string& key) override;
  /// True when every key exists.
  bool check(const std::vector<std::string>& keys) override;
  /// Number of keys stored.
  int64_t getNumKeys() override;
  /// Waits for every key, up to the store's timeout.
  void wait(const std::vector<std::string>& keys) override;
  /// Waits for every key, up to `timeout`.
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  /// A new client connection to the same store (LibTorch 2.x's c10d::Store
  /// requires it; it overrides there and is a plain member with 1.13).
  c10::intrusive_ptr<c10d::Store> clone() FSDP_STORE_CLONE_OVERRIDE;

 private:
  // Sends `message` and returns the reply; `server_wait` is how long the
  // server may hold it (a get's or wait's timeout), on top of timeout_.
  std::vector<uint8_t> request(const std::vector<uint8_t>& message,
                               std::chrono::milliseconds server_wait = {});
  std::string address() const;

  std::unique_ptr<detail::StoreServer> server_;  // only on the server rank
  std::string host_;
  int port_ = 0;
  std::string job_token_;
  std::mutex mutex_;  // one request at a time on fd_
  // State below is protected by mutex_.
  int fd_ = -1;            // -1 once a request failed: the stream is out of step
  bool accepted_ = false;  // the server answered our handshake (read with the first reply)
  std::string broken_;     // why fd_ was closed
};

}  // namespace fsdp
