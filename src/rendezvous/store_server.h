#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "rendezvous/job_token.h"
#include "rendezvous/socket.h"

namespace fsdp::detail {

/// The key-value server behind TcpStore: one thread running a poll() loop over
/// the listening socket and every connection. See Note [Store server].
class StoreServer {
 public:
  /// Listens on listen_addr:port (0: any free port); serves only connections
  /// that present `job_token` first (Note [Job token]).
  StoreServer(const std::string& listen_addr, int port, std::string job_token);
  /// Stops the loop; every connection is closed.
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  /// The bound port.
  int port() const { return port_; }

  /// Most connections held at once; beyond it the oldest connection that
  /// never sent a request is closed to make room (else the new one is).
  static constexpr size_t kMaxConnections = 4096;

 private:
  using Clock = std::chrono::steady_clock;

  // A get or wait whose keys are not all there yet.
  struct Parked {
    bool is_get = false;  // get replies with the value, wait with the status only
    std::vector<std::string> keys;
    Clock::time_point deadline;  // time_point::max(): no limit
  };
  // A connection is served once its handshake presented the job token.
  enum class Phase : uint8_t { kHandshake, kServing };
  struct Connection {
    UniqueFd fd;
    Phase phase = Phase::kHandshake;
    HandshakeReader handshake;
    Clock::time_point handshake_until;  // closed if still in kHandshake then
    uint64_t serial = 0;                // accept order, for eviction
    bool spoke = false;                 // sent at least one whole request
    std::vector<uint8_t> in;            // received bytes not yet a whole request
    std::vector<uint8_t> out;           // reply bytes not yet sent, from out_at
    size_t out_at = 0;
    std::optional<Parked> parked;
  };

  void run();
  void accept_new(Clock::time_point now);
  // Closes the oldest connection that never sent a request; false if none.
  bool make_room();
  // Each returns false when the connection must be closed.
  bool read_from(Connection& c);
  bool read_handshake(Connection& c);
  void close_slow_handshakes(Clock::time_point now);
  bool write_to(Connection& c);
  bool serve_requests(Connection& c);
  void handle(Connection& c, const std::vector<uint8_t>& request);
  void reply(Connection& c, std::vector<uint8_t> message);
  void answer_parked(Clock::time_point now);
  bool present(const std::vector<std::string>& keys) const;
  Clock::time_point next_deadline() const;

  // Constant after construction.
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;  // an eventfd: the destructor's stop signal
  int port_ = 0;
  std::string job_token_;

  // State below is touched by the loop thread only.
  std::map<std::string, std::vector<uint8_t>> data_;
  std::map<int, Connection> connections_;  // by fd
  uint64_t accepted_ = 0;
  Clock::time_point accept_paused_until_{};

  std::thread loop_;
};

}  // namespace fsdp::detail
