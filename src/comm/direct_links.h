#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/ring.h"
#include "rendezvous/socket.h"

namespace fsdp::detail {

/// Note [Direct links for small collectives]
/// FSDP's per-unit collectives on small units are latency-bound: through
/// Gloo's unbound buffers each message costs a wake-up of Gloo's event-loop
/// thread and then of the waiting thread. A direct link is a plain blocking
/// TCP connection to the ring neighbours (one to `next` for sending, one from
/// `prev` for receiving) on which a message is one writev() and one or two
/// recv()s in the thread that runs the collective. Messages carry a header
/// (slot, bytes) checked on arrival, so a mismatch fails loudly. A small
/// message (at most CommConfig::direct_link_bytes) is sent at once by the
/// calling thread, as far as the socket's buffer takes it without waiting;
/// the rest goes to the sender thread below. A ring step posts all its
/// sends before its receives, and the buffers a kernel grants are capped
/// (net.core.wmem_max), so a calling thread that blocked on a full link
/// could wait on a peer blocked the same way.
///
/// Note [Direct links for large collectives]
/// Builds without Gloo (pip's LibTorch wheel ships no Gloo headers; see
/// Note [Gloo or not]) carry every collective between hosts over the same
/// links. A ring step posts all its sends before its receives, so blocking
/// sends of messages larger than the socket buffers would deadlock: every
/// rank writing, none reading. Larger messages (and any message queued behind
/// one) therefore go to a sender thread per group that writes them in order
/// while the calling thread receives, so each link carries data both ways at
/// once. Receives stay in the calling thread, in the order they were posted,
/// which is the order the peer sent them.
class DirectLinks : public PointToPoint {
 public:
  /// Connects rank `rank` of `size` (>= 2) to its ring neighbours through
  /// `store` (keys are this group's own). Collective over the group. Messages
  /// of at most `inline_bytes` (CommConfig::direct_link_bytes) are sent by the
  /// calling thread when nothing is queued before them, as far as the socket
  /// takes them without waiting; the sender thread writes the rest. Each link presents
  /// `job_token` first; connections to the listener without it are refused
  /// (Note [Job token]). With `realtime` the sender thread asks for
  /// real-time priority (Note [Communication threads preempt compute]).
  DirectLinks(c10d::Store& store, int rank, int size, const std::string& listen_addr,
              std::chrono::milliseconds timeout, int64_t inline_bytes, const std::string& job_token,
              bool realtime = false);
  /// Stops the sender thread (a send in progress fails) and closes the links.
  ~DirectLinks() override;

  std::unique_ptr<PendingTransfer> isend(const at::Tensor& src, int peer, uint64_t slot) override;
  std::unique_ptr<PendingTransfer> irecv(const at::Tensor& dst, int peer, uint64_t slot) override;

  /// Receives the next message from `prev`, which must be `slot` of `bytes`.
  void receive(void* dst, size_t bytes, uint64_t slot);

  /// The group broke (Note [Broken groups]): shuts both links down, so that
  /// the neighbours' sends and receives fail at once. Any thread.
  void abort();

  /// A queued send and its completion, shared with its waiter.
  struct Outgoing;

 private:
  void sender_loop();

  const int rank_, next_, prev_;
  const int64_t inline_bytes_;  // largest message the calling thread sends itself
  UniqueFd to_next_, from_prev_;

  // State below is protected by mutex_ (see Note [Direct links for large collectives]).
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Outgoing>> queue_;  // queued and in-flight sends, in order
  bool stopping_ = false;

  std::thread sender_;  // last: started after everything it uses
};

}  // namespace fsdp::detail
