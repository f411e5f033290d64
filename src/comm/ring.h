#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

#include <fsdp/comm/types.h>

namespace fsdp::detail {

/// A posted send or receive; wait() blocks until it completed or throws.
class PendingTransfer {
 public:
  virtual ~PendingTransfer() = default;
  /// Blocks until the transfer completed; throws on error or timeout.
  virtual void wait() = 0;
};

/// Point-to-point messaging inside one group, the only thing the ring
/// algorithms need from an engine (Gloo's unbound buffers, c10d send/recv).
/// A message is matched by (peer, slot); slots are unique within a collective.
class PointToPoint {
 public:
  virtual ~PointToPoint() = default;
  /// Starts sending the bytes of contiguous `src` to `peer`.
  virtual std::unique_ptr<PendingTransfer> isend(const at::Tensor& src, int peer,
                                                 uint64_t slot) = 0;
  /// Starts receiving into contiguous `dst` from `peer`.
  virtual std::unique_ptr<PendingTransfer> irecv(const at::Tensor& dst, int peer,
                                                 uint64_t slot) = 0;
};

// Every ring below cuts its chunks into segments of `segment_bytes`
// (CommConfig::ring_segment_bytes): it adds or forwards one segment while the
// next one is on the wire.

/// Ring all-gather straight into `flat` (see Note [Ring collectives] in ring.cpp).
/// Uses slots [slot_base, slot_base + (size - 1) * segments).
void ring_all_gather(PointToPoint& p2p, int rank, int size, const at::Tensor& flat,
                     const at::Tensor& shard, uint64_t slot_base, int64_t segment_bytes);

/// Ring reduce-scatter of `flat` into `shard` (any ReduceOp, Note [One
/// reduction]); `flat` is left untouched. `scratch` (shard-sized) is needed
/// only when size >= 3.
void ring_reduce_scatter(PointToPoint& p2p, int rank, int size, const at::Tensor& flat,
                         const at::Tensor& shard, const at::Tensor& scratch, ReduceOp op,
                         uint64_t slot_base, int64_t segment_bytes);

/// Ring broadcast of `flat` from `root`: a chain root -> root + 1 -> ... whose
/// segments are forwarded as soon as they arrive. Uses slots [slot_base, slot_base + segments).
void ring_broadcast(PointToPoint& p2p, int rank, int size, const at::Tensor& flat, int root,
                    uint64_t slot_base, int64_t segment_bytes);

}  // namespace fsdp::detail
