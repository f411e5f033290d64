#include "comm/ring.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "comm/reduce.h"

// Note [Ring collectives]
// Both collectives walk a ring (rank r sends to r + 1 and receives from r - 1)
// in size - 1 steps, so each rank sends and receives exactly (size - 1)/size
// of the flat buffer: the bandwidth optimum. Every chunk is cut into segments
// of CommConfig::ring_segment_bytes (1 MiB unless set), and segment k of step
// s is forwarded (all-gather) or reduced and forwarded (reduce-scatter) as
// soon as it arrived, while later segments are still on the wire. Nothing
// full-sized is allocated:
// - all-gather receives every chunk straight into its place in `flat`; all
//   receives are posted up front since their destinations never overlap.
// - reduce-scatter at step s sends the partial sum of chunk (r - s - 1) and
//   receives the partial sum of chunk (r - s - 2), to which it adds its own
//   contribution; the last step's chunk is r itself. Partial sums alternate
//   between `shard` and `scratch`, arranged so the last lands in `shard`.
//   Step 0 sends straight from `flat`, which is never written.
// Neither waits for a send before it has read every receive it posted
// earlier, so they also run on transports whose receives progress only
// while waited for (Note [Direct links for large collectives]).

namespace fsdp::detail {

namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

struct Segments {
  int64_t numel;  // of a whole chunk
  int64_t seg;    // elements per segment
  int64_t count;
  at::Tensor of(const at::Tensor& t, int64_t k) const {
    return t.narrow(0, k * seg, std::min(seg, numel - k * seg));
  }
};

Segments segments_of(const at::Tensor& shard, int64_t segment_bytes) {
  const int64_t seg =
      std::max<int64_t>(1, segment_bytes / static_cast<int64_t>(shard.element_size()));
  return Segments{shard.numel(), seg, std::max<int64_t>(1, (shard.numel() + seg - 1) / seg)};
}

void wait_all(std::vector<std::unique_ptr<PendingTransfer>>& transfers) {
  for (auto& t : transfers) t->wait();
  transfers.clear();
}

}  // namespace

void ring_all_gather(PointToPoint& p2p, int rank, int size, const at::Tensor& flat,
                     const at::Tensor& shard, uint64_t slot_base, int64_t segment_bytes) {
  const int64_t n = shard.numel();
  auto chunk = [&](int c) { return flat.narrow(0, c * n, n); };
  at::Tensor own = chunk(rank);
  const bool in_place = own.data_ptr() == shard.data_ptr();
  if (size == 1 || n == 0) {
    if (!in_place) own.copy_(shard);
    return;
  }
  const Segments segs = segments_of(shard, segment_bytes);
  const int next = mod(rank + 1, size), prev = mod(rank - 1, size);
  auto slot = [&](int s, int64_t k) { return slot_base + s * segs.count + k; };

  // Step s sends chunk (r - s) and receives chunk (r - s - 1).
  std::vector<std::vector<std::unique_ptr<PendingTransfer>>> recvs(size - 1);
  for (int s = 0; s < size - 1; ++s) {
    for (int64_t k = 0; k < segs.count; ++k) {
      recvs[s].push_back(p2p.irecv(segs.of(chunk(mod(rank - s - 1, size)), k), prev, slot(s, k)));
    }
  }
  // Step 0 sends from `shard` itself, so the local copy into `flat` overlaps
  // the transfers instead of delaying them.
  std::vector<std::unique_ptr<PendingTransfer>> sends;
  for (int64_t k = 0; k < segs.count; ++k) {
    sends.push_back(p2p.isend(segs.of(shard, k), next, slot(0, k)));
  }
  if (!in_place) own.copy_(shard);
  for (int s = 1; s < size - 1; ++s) {
    for (int64_t k = 0; k < segs.count; ++k) {
      recvs[s - 1][k]->wait();
      sends.push_back(p2p.isend(segs.of(chunk(mod(rank - s, size)), k), next, slot(s, k)));
    }
  }
  for (auto& t : recvs.back()) t->wait();
  wait_all(sends);
}

void ring_reduce_scatter(PointToPoint& p2p, int rank, int size, const at::Tensor& flat,
                         const at::Tensor& shard, const at::Tensor& scratch, ReduceOp op,
                         uint64_t slot_base, int64_t segment_bytes) {
  const int64_t n = shard.numel();
  auto chunk = [&](int c) { return flat.narrow(0, c * n, n); };
  if (size == 1 || n == 0) {
    if (n > 0) shard.copy_(chunk(0));
    return;
  }
  const Segments segs = segments_of(shard, segment_bytes);
  const int next = mod(rank + 1, size), prev = mod(rank - 1, size);
  auto slot = [&](int s, int64_t k) { return slot_base + s * segs.count + k; };
  auto recv_buf = [&](int s) -> const at::Tensor& {
    return (size - 2 - s) % 2 == 0 ? shard : scratch;
  };

  // Step s reads what step s - 1 received, adds its own contribution and
  // sends it on; only then does it wait for step s - 1's sends, because
  // recv_buf(s) is what they were sent from. Waiting for sends only after
  // reading keeps transports whose receives progress only when waited for
  // (the direct links) from deadlocking: every rank's peer has read, or
  // will read without waiting, what it was sent.
  std::vector<std::unique_ptr<PendingTransfer>> sends, recvs;
  for (int s = 0; s < size - 1; ++s) {
    std::vector<std::unique_ptr<PendingTransfer>> step_sends;
    for (int64_t k = 0; k < segs.count; ++k) {
      at::Tensor src;
      if (s == 0) {
        src = segs.of(chunk(mod(rank - 1, size)), k);
      } else {
        recvs[k]->wait();
        src = segs.of(recv_buf(s - 1), k);
        reduce_into(src, src, segs.of(chunk(mod(rank - s - 1, size)), k), op);
      }
      step_sends.push_back(p2p.isend(src, next, slot(s, k)));
    }
    wait_all(sends);  // step s - 1's: recv_buf(s) is what they were sent from
    sends = std::move(step_sends);
    recvs.clear();
    for (int64_t k = 0; k < segs.count; ++k) {
      recvs.push_back(p2p.irecv(segs.of(recv_buf(s), k), prev, slot(s, k)));
    }
  }
  for (int64_t k = 0; k < segs.count; ++k) {
    recvs[k]->wait();
    const at::Tensor out = segs.of(shard, k);
    reduce_into(out, out, segs.of(chunk(rank), k), op);
  }
  wait_all(sends);
  finish_reduction(shard, op, size);
}

void ring_broadcast(PointToPoint& p2p, int rank, int size, const at::Tensor& flat, int root,
                    uint64_t slot_base, int64_t segment_bytes) {
  if (size == 1 || flat.numel() == 0) return;
  const Segments segs = segments_of(flat, segment_bytes);
  const int next = mod(rank + 1, size), prev = mod(rank - 1, size);
  std::vector<std::unique_ptr<PendingTransfer>> sends;
  for (int64_t k = 0; k < segs.count; ++k) {
    const at::Tensor seg = segs.of(flat, k);
    if (rank != root) p2p.irecv(seg, prev, slot_base + k)->wait();
    if (next != root) sends.push_back(p2p.isend(seg, next, slot_base + k));
  }
  wait_all(sends);
}

}  // namespace fsdp::detail
