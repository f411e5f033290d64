#include "comm/gloo_process_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>

#include "comm/comm_thread.h"
#include "comm/direct_links.h"
#include "comm/gloo_engine.h"
#include "comm/ring.h"
#include "comm/shm_links.h"

namespace fsdp::detail {

namespace {

// Our ring slots live under their own prefix byte, far from the slots Gloo's
// own algorithms build (Gloo's tags are 32 bits), and carry the collective's sequence number.
constexpr uint64_t kRingSlotPrefix = 0x40;
uint64_t ring_slot_base(uint64_t seq) {
  return (kRingSlotPrefix << 56) | ((seq & 0xffffffu) << 24);
}
// Fingerprints (Note [Collective fingerprints]) under a prefix of their own.
constexpr uint64_t kFingerprintSlotPrefix = 0x41;
uint64_t fingerprint_slot_base(uint64_t seq) {
  return (kFingerprintSlotPrefix << 56) | ((seq & 0xffffffu) << 24);
}

}  // namespace

GlooProcessGroup::GlooProcessGroup(c10::intrusive_ptr<c10d::Store> store, const std::string& prefix,
                                   int rank, int size, std::chrono::milliseconds timeout,
                                   std::string listen_addr)
    : ProcessGroup(rank, size, timeout),
      store_(std::move(store)),
      prefix_(prefix),
      listen_addr_(std::move(listen_addr)) {
  if (size > 1) {
    TORCH_CHECK(store_, "fsdp: a process group of ", size, " ranks needs a store");
    gloo_ = connect_gloo(store_, prefix_, rank, size, timeout, listen_addr_);
    c10d::PrefixStore group_store(prefix_, store_);
    // Without Gloo the links carry every collective shared memory does not.
    if (!gloo_ || DirectLinks::max_message_bytes() > 0) {
      links_ = std::make_unique<DirectLinks>(group_store, rank, size, listen_addr_, timeout);
    }
    shm_ = ShmLinks::connect(group_store, rank, size, timeout);
  }
  thread_ = std::make_unique<CommThread>(rank, timeout);
  thread_->set_fingerprint_exchange(
      [this](const at::Tensor& mine, uint64_t seq) { return exchange_fingerprints(mine, seq); });
  set_debug_collectives(debug_requested_by_env());
}

void GlooProcessGroup::set_debug_collectives(bool on) { thread_->set_debug(on && size() > 1); }

bool GlooProcessGroup::debug_collectives() const { return thread_->debug(); }

at::Tensor GlooProcessGroup::exchange_fingerprints(const at::Tensor& mine, uint64_t seq) {
  at::Tensor all = at::empty({size() * mine.numel()}, mine.options());
  ring_all_gather(ring_transport(mine.nbytes()), rank(), size(), all, mine,
                  fingerprint_slot_base(seq));
  return all.view({size(), mine.numel()});
}

GlooProcessGroup::~GlooProcessGroup() { thread_.reset(); }

std::string GlooProcessGroup::backend_name() const {
  if (size() == 1) return "local";
  return gloo_ ? "gloo" : "tcp";
}

Work GlooProcessGroup::submit(CollectiveKind kind, const std::string& what,
                              std::vector<at::Tensor> tensors, int64_t detail,
                              std::function<void(uint64_t seq)> body) {
  if (size() == 1) return thread_->run_inline(kind, what, std::move(tensors), detail, body);
  return thread_->enqueue(kind, what, std::move(tensors), detail, std::move(body));
}

// Note [Routes of collectives]
// Every collective of a group of two or more ranks takes one route, chosen
// here and nowhere else:
// | collective                  | route                                         |
// |-----------------------------|-----------------------------------------------|
// | all-gather, reduce-scatter  | per-rank chunk <= small: direct links (ring)  |
// |                             | else all ranks on this host: shared memory    |
// |                             | else Gloo's pairs (ring), or without Gloo the |
// |                             | direct links (ring, sender thread)            |
// | all-reduce                  | whole tensor <= small x size: direct links    |
// |                             | (reduce-scatter + all-gather rings)           |
// |                             | else shared memory, else Gloo's all-reduce,   |
// |                             | else direct links as for small                |
// | broadcast, barrier          | Gloo, or without Gloo direct links (rings)    |
// "small" is DirectLinks::max_message_bytes() (FSDP_DIRECT_LINK_BYTES; 0 sends
// nothing small over the links), shared memory is on unless FSDP_SHM=0 or a
// rank is elsewhere (Note [Shared memory for same-host ranks]), and Gloo is
// there with LibTorch 1.13 only (Note [Gloo or not]).
GlooProcessGroup::Route GlooProcessGroup::route(CollectiveKind kind, int64_t bytes) const {
  const int64_t small = DirectLinks::max_message_bytes();
  switch (kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
      if (links_ && bytes <= small) return Route::kLinks;
      if (shm_) return Route::kShm;
      return gloo_ ? Route::kGloo : Route::kLinks;
    case CollectiveKind::kAllReduce:
      if (links_ && bytes <= small * size()) return Route::kLinks;
      if (shm_) return Route::kShm;
      return gloo_ ? Route::kGloo : Route::kLinks;
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kBarrier:
      break;
  }
  return gloo_ ? Route::kGloo : Route::kLinks;
}

PointToPoint& GlooProcessGroup::ring_transport(size_t chunk_bytes) {
  const auto r = route(CollectiveKind::kAllGather, static_cast<int64_t>(chunk_bytes));
  return r == Route::kLinks || !gloo_ ? static_cast<PointToPoint&>(*links_) : gloo_->p2p();
}

at::Tensor GlooProcessGroup::scratch_like(const at::Tensor& shard) {
  const int64_t bytes = static_cast<int64_t>(shard.nbytes());
  if (!scratch_.defined() || scratch_.numel() < bytes) scratch_ = at::empty({bytes}, at::kByte);
  return scratch_.narrow(0, 0, bytes).view(shard.scalar_type()).view(shard.sizes());
}

Work GlooProcessGroup::all_gather_into_tensor(const at::Tensor& flat, const at::Tensor& shard) {
  check_all_gather(flat, shard);
  return submit(CollectiveKind::kAllGather, describe_tensor(flat), {flat, shard}, -1,
                [this, flat, shard](uint64_t seq) {
                  const at::Tensor f = flat.view({-1}), s = shard.view({-1});
                  if (size() == 1) {
                    if (f.data_ptr() != s.data_ptr()) f.copy_(s);
                    return;
                  }
                  const int64_t bytes = static_cast<int64_t>(s.nbytes());
                  if (route(CollectiveKind::kAllGather, bytes) == Route::kShm) {
                    return shm_->all_gather(f, s);
                  }
                  ring_all_gather(ring_transport(s.nbytes()), rank(), size(), f, s,
                                  ring_slot_base(seq));
                });
}

Work GlooProcessGroup::reduce_scatter_tensor(const at::Tensor& shard, const at::Tensor& flat,
                                             ReduceOp op) {
  check_reduce_scatter(shard, flat, op);
  return submit(CollectiveKind::kReduceScatter, describe_tensor(flat) + ", " + to_string(op),
                {flat, shard}, static_cast<int64_t>(op), [this, flat, shard, op](uint64_t seq) {
                  const at::Tensor f = flat.view({-1}), s = shard.view({-1});
                  if (size() == 1) {
                    s.copy_(f);
                    return;
                  }
                  const int64_t bytes = static_cast<int64_t>(s.nbytes());
                  if (route(CollectiveKind::kReduceScatter, bytes) == Route::kShm) {
                    return shm_->reduce_scatter(f, s, op);
                  }
                  at::Tensor scratch = size() >= 3 ? scratch_like(s) : at::Tensor();
                  ring_reduce_scatter(ring_transport(s.nbytes()), rank(), size(), f, s, scratch,
                                      op, ring_slot_base(seq));
                });
}

Work GlooProcessGroup::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  check_single("all_reduce", tensor);
  return submit(
      CollectiveKind::kAllReduce, describe_tensor(tensor) + ", " + to_string(op), {tensor},
      static_cast<int64_t>(op), [this, tensor, op](uint64_t seq) {
        if (size() == 1 || tensor.numel() == 0) return;
        switch (route(CollectiveKind::kAllReduce, static_cast<int64_t>(tensor.nbytes()))) {
          case Route::kLinks:
            return ring_all_reduce_over_links(tensor, op, seq);
          case Route::kShm:
            return shm_->all_reduce(tensor, op);
          case Route::kGloo:
            return gloo_->all_reduce(tensor, op, seq);
        }
      });
}

void GlooProcessGroup::ring_all_reduce_over_links(const at::Tensor& tensor, ReduceOp op, uint64_t seq) {
  // A reduce-scatter then an all-gather over the direct links, on a copy
  // padded to a multiple of the group size (the padding is never read back).
  const int64_t numel = tensor.numel(), per = (numel + size() - 1) / size();
  at::Tensor flat = at::zeros({per * size()}, tensor.options());
  flat.narrow(0, 0, numel).copy_(tensor.view({-1}));
  at::Tensor shard = at::empty({per}, tensor.options());
  at::Tensor scratch = size() >= 3 ? scratch_like(shard) : at::Tensor();
  const uint64_t base = ring_slot_base(seq);
  ring_reduce_scatter(*links_, rank(), size(), flat, shard, scratch, op, base);
  ring_all_gather(*links_, rank(), size(), flat, shard, base + (uint64_t{1} << 20));
  tensor.view({-1}).copy_(flat.narrow(0, 0, numel));
}

Work GlooProcessGroup::broadcast(const at::Tensor& tensor, int root) {
  check_single("broadcast", tensor);
  check_root(root);
  return submit(
      CollectiveKind::kBroadcast, describe_tensor(tensor) + ", root " + std::to_string(root),
      {tensor}, root, [this, tensor, root](uint64_t seq) {
        if (size() == 1 || tensor.numel() == 0) return;
        if (route(CollectiveKind::kBroadcast, 0) == Route::kGloo) {
          return gloo_->broadcast(tensor, root, seq);
        }
        ring_broadcast(*links_, rank(), size(), tensor.view({-1}), root, ring_slot_base(seq));
      });
}

Work GlooProcessGroup::barrier() {
  return submit(CollectiveKind::kBarrier, "", {}, -1, [this](uint64_t seq) {
    if (size() == 1) return;
    if (route(CollectiveKind::kBarrier, 0) == Route::kGloo) return gloo_->barrier(seq);
    at::Tensor token = at::zeros({1}, at::kFloat);
    ring_all_reduce_over_links(token, ReduceOp::kSum, seq);
  });
}

std::shared_ptr<ProcessGroup> GlooProcessGroup::new_subgroup(const std::vector<int>& ranks) {
  check_subgroup_ranks(ranks);
  const std::string prefix = prefix_ + "/sub" + std::to_string(subgroups_made_++);
  auto it = std::find(ranks.begin(), ranks.end(), rank());
  if (it == ranks.end()) return nullptr;
  const int sub_rank = static_cast<int>(it - ranks.begin());
  auto sub = std::make_shared<GlooProcessGroup>(
      store_, prefix, sub_rank, static_cast<int>(ranks.size()), timeout(), listen_addr_);
  sub->set_debug_collectives(debug_collectives());
  if (sub->size() > 1) sub->barrier().wait();  // everyone connected before use
  return sub;
}

}  // namespace fsdp::detail
