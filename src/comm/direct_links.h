#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "comm/ring.h"
#include "comm/socket.h"

namespace fsdp::detail {

/// Note [Direct links for small collectives]
/// FSDP's per-unit collectives on small units are latency-bound: through
/// Gloo's unbound buffers each message costs a wake-up of Gloo's event-loop
/// thread and then of the waiting thread. A direct link is a plain blocking
/// TCP connection to the ring neighbours (one to `next` for sending, one from
/// `prev` for receiving) on which a message is one writev() and one or two
/// recv()s in the thread that runs the collective. Messages carry a header
/// (slot, bytes) checked on arrival, so a mismatch fails loudly. Sends happen
/// at once (isend blocks until written), which cannot deadlock because a
/// message is at most max_message_bytes(), well below the socket buffers set
/// here; larger collectives keep using Gloo's pipelined transfers.
class DirectLinks : public PointToPoint {
 public:
  /// Connects rank `rank` of `size` (>= 2) to its ring neighbours through
  /// `store` (keys are this group's own). Collective over the group.
  DirectLinks(c10d::Store& store, int rank, int size, const std::string& listen_addr,
              std::chrono::milliseconds timeout);

  /// Largest message sent over the links (FSDP_DIRECT_LINK_BYTES overrides
  /// the default 64 KiB; 0 turns direct links off).
  static int64_t max_message_bytes();

  std::unique_ptr<PendingTransfer> isend(const at::Tensor& src, int peer, uint64_t slot) override;
  std::unique_ptr<PendingTransfer> irecv(const at::Tensor& dst, int peer, uint64_t slot) override;

  /// Receives the next message from `prev`, which must be `slot` of `bytes`.
  void receive(void* dst, size_t bytes, uint64_t slot);

 private:
  const int rank_, next_, prev_;
  const std::chrono::milliseconds timeout_;
  UniqueFd to_next_, from_prev_;
};

}  // namespace fsdp::detail
