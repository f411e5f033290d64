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
#include "detail/error.h"
#include "detail/inference_mode.h"

namespace fsdp::detail {

namespace {

// Note [What a ring slot says]
// Our ring slots live under their own prefix byte, far from the slots Gloo's
// own algorithms build (Gloo's tags are 32 bits), and carry the collective's
// sequence number (bits 24-47) and a digest of what the collective is (bits
// 48-55): its kind, its dtype, its reduce op or root. Ranks that issued
// different collectives of the same size at the same place (one rank's
// all-reduce of a sum where another's is of a max, an all-gather against a
// reduce-scatter of a unit of the same size) exchanged their bytes silently
// and computed garbage; now the direct links' header check fails at the
// first message, on the ranks that receive it, naming "different
// collectives" (Gloo's pairs match messages by slot: they wait for the
// timeout instead). The digest is a byte: one such mismatch in 251 passes
// unseen; FSDP_DEBUG=detail's fingerprints see every one.
constexpr uint64_t kRingSlotPrefix = 0x40;
uint64_t ring_slot_base(uint64_t seq, CollectiveKind kind, at::ScalarType dtype,
                        int64_t op_or_root) {
  const uint64_t what = (static_cast<uint64_t>(kind) * 61 + static_cast<uint64_t>(dtype)) * 61 +
                        static_cast<uint64_t>(op_or_root + 1);
  const uint64_t digest = what % 251 + 1;
  return (kRingSlotPrefix << 56) | (digest << 48) | ((seq & 0xffffffu) << 24);
}
// Fingerprints (Note [Collective fingerprints]) under a prefix of their own.
constexpr uint64_t kFingerprintSlotPrefix = 0x41;
uint64_t fingerprint_slot_base(uint64_t seq) {
  return (kFingerprintSlotPrefix << 56) | ((seq & 0xffffffu) << 24);
}

}  // namespace

const char* to_string(Route route) {
  switch (route) {
    case Route::kLinks:
      return "links";
    case Route::kShm:
      return "shm";
    case Route::kGloo:
      return "gloo";
  }
  return "?";
}

GlooProcessGroup::GlooProcessGroup(c10::intrusive_ptr<c10d::Store> store, const std::string& prefix,
                                   int rank, int size, std::chrono::milliseconds timeout,
                                   std::string listen_addr, const CommConfig& config)
    : ProcessGroup(rank, size, timeout),
      store_(std::move(store)),
      prefix_(prefix),
      listen_addr_(std::move(listen_addr)),
      config_(config) {
  if (size > 1) {
    FSDP_CHECK(store_, rank, "process group", "a process group of ", size, " ranks needs a store");
    // What the group opens decides which routes it has: see Note [Routes of collectives].
    gloo_ = connect_gloo(store_, prefix_, rank, size, timeout, listen_addr_);
    c10d::PrefixStore group_store(prefix_, store_);
    if (!gloo_ || config_.direct_link_bytes > 0) {
      links_ = std::make_unique<DirectLinks>(group_store, rank, size, listen_addr_, timeout,
                                             config_.direct_link_bytes, config_.job_token,
                                             config_.realtime_threads);
    }
    shm_ = ShmLinks::connect(group_store, rank, size, timeout, config_.shared_memory,
                             config_.shm_slot_bytes);
  }
  thread_ = std::make_unique<CommThread>(rank, timeout, config_.realtime_threads);
  thread_->set_fingerprint_exchange(
      [this](const at::Tensor& mine, uint64_t seq) { return exchange_fingerprints(mine, seq); });
  // See Note [Broken groups]. Shared memory stops its peers by itself.
  thread_->set_on_broken([this] {
    if (links_) links_->abort();
    if (gloo_) gloo_->abort();
  });
}

void GlooProcessGroup::set_debug_collectives(bool on) { thread_->set_debug(on && size() > 1); }

bool GlooProcessGroup::debug_collectives() const { return thread_->debug(); }

at::Tensor GlooProcessGroup::exchange_fingerprints(const at::Tensor& mine, uint64_t seq) {
  // Routed like any all-gather of its size, but not counted in route_count().
  at::Tensor all = at::empty({size() * mine.numel()}, mine.options());
  all_gather_over(route(CollectiveKind::kAllGather, static_cast<int64_t>(mine.nbytes())), all, mine,
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
// A collective of a group of two or more ranks takes one of three routes
// (Route), decided by route() and nowhere else, from what the group opened
// when it was made and the collective's per-rank chunk C: the shard of an
// all-gather or reduce-scatter; ceil(numel / size) elements of an
// all-reduce (the chunk its rings move). L is CommConfig::direct_link_bytes.
//
// | collective      | first that holds      | route  | how                              |
// |-----------------|-----------------------|--------|----------------------------------|
// | all-gather,     | links open and C <= L | kLinks | ring over the direct links       |
// | reduce-scatter, | shared memory open    | kShm   | rounds through the segment       |
// | all-reduce      | Gloo built            | kGloo  | ring over Gloo's pairs           |
// |                 | otherwise             | kLinks | ring over the direct links       |
// | broadcast       | Gloo built            | kGloo  | chain over Gloo's pairs          |
// |                 | otherwise             | kLinks | chain over the direct links      |
// | barrier         | Gloo built            | kGloo  | 1-element all-reduce, Gloo pairs |
// |                 | otherwise             | kLinks | 1-element all-reduce, links      |
// | fingerprints    | routed as an all-gather of their size; not in route_count()     |
//
// All-reduce over the links or Gloo's pairs is a reduce-scatter ring then an
// all-gather ring on a copy padded to a multiple of the group size; over
// shared memory every rank sums all slots in rank order (the same bits
// everywhere). Gloo's own all-reduce, broadcast and barrier are not used:
// each destroys its buffers at once, which spins (Note [Gloo's buffers let
// go later]); their rings over the same pairs keep them for later.
//
// What a group opens (its constructor):
// | transport     | opened when                                                    |
// |---------------|----------------------------------------------------------------|
// | Gloo          | built with Gloo: LibTorch 1.13 builds (Note [Gloo or not])     |
// | direct links  | Gloo absent, or L > 0                                          |
// | shared memory | every rank on this host and CommConfig::shared_memory on every |
// |               | rank (Note [Shared memory for same-host ranks])                |
//
// Sizes below the routes (none of them changes a route):
// | knob (default)                    | where it acts                                     |
// |-----------------------------------|---------------------------------------------------|
// | direct_link_bytes L (64 KiB)      | inside the links: messages <= L are written by    |
// |                                   | the calling thread, larger ones (and any queued   |
// |                                   | behind one) by the sender thread (Note [Direct    |
// |                                   | links for large collectives])                     |
// | ring_segment_bytes (1 MiB)        | segment of every ring, over links or Gloo's pairs |
// | shm_slot_bytes (2 MiB)            | bytes per rank and round through shared memory    |
//
// So by default a build with Gloo (1.13) sends C <= 64 KiB over the links,
// larger chunks through shared memory on one host and over Gloo across
// hosts, and broadcast and barrier over Gloo; a build without (2.15) sends
// what shared memory does not carry, broadcast and barrier too, over the
// links. ProcessGroupOptions forces each route (tests/comm/test_routes.cpp):
// direct_link_bytes(0) sends every size through shared memory on one host;
// shared_memory(false) with direct_link_bytes(0) sends everything over Gloo
// (1.13) or over the links' sender thread (2.15).
Route GlooProcessGroup::route(CollectiveKind kind, int64_t chunk_bytes) const {
  switch (kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllReduce:
      if (links_ && chunk_bytes <= config_.direct_link_bytes) return Route::kLinks;
      if (shm_) return Route::kShm;
      break;
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kBarrier:
      break;
  }
  return gloo_ ? Route::kGloo : Route::kLinks;
}

namespace {
size_t route_index(CollectiveKind kind, Route route) {
  return static_cast<size_t>(kind) * kRouteCount + static_cast<size_t>(route);
}
}  // namespace

Route GlooProcessGroup::take_route(CollectiveKind kind, int64_t chunk_bytes) {
  const Route r = route(kind, chunk_bytes);
  route_counts_[route_index(kind, r)].fetch_add(1, std::memory_order_relaxed);
  return r;
}

uint64_t GlooProcessGroup::route_count(CollectiveKind kind, Route route) const {
  return route_counts_[route_index(kind, route)].load(std::memory_order_relaxed);
}

PointToPoint& GlooProcessGroup::ring_transport(Route route) {
  TORCH_INTERNAL_ASSERT(
      route == Route::kLinks ? links_ != nullptr : route == Route::kGloo && gloo_ != nullptr,
      "no ring transport for route ", to_string(route));
  return route == Route::kLinks ? static_cast<PointToPoint&>(*links_) : gloo_->p2p();
}

void GlooProcessGroup::all_gather_over(Route route, const at::Tensor& flat, const at::Tensor& shard,
                                       uint64_t base) {
  if (route == Route::kShm) return shm_->all_gather(flat, shard);
  ring_all_gather(ring_transport(route), rank(), size(), flat, shard, base,
                  config_.ring_segment_bytes);
}

at::Tensor GlooProcessGroup::scratch_like(const at::Tensor& shard) {
  const int64_t bytes = static_cast<int64_t>(shard.nbytes());
  if (!scratch_.defined() || scratch_.numel() < bytes) {
    // Kept for later collectives: a normal tensor, also when this one runs
    // under c10::InferenceMode (Note [Inference mode]).
    const OutsideInferenceMode outside;
    scratch_ = at::empty({bytes}, at::kByte);
  }
  return scratch_.narrow(0, 0, bytes).view(shard.scalar_type()).view(shard.sizes());
}

Work GlooProcessGroup::all_gather_into_tensor(const at::Tensor& flat, const at::Tensor& shard) {
  check_all_gather(flat, shard);
  return submit(
      CollectiveKind::kAllGather, describe_tensor(flat), {flat, shard}, -1,
      [this, flat, shard](uint64_t seq) {
        const at::Tensor f = flat.view({-1}), s = shard.view({-1});
        if (size() == 1) {
          if (f.data_ptr() != s.data_ptr()) f.copy_(s);
          return;
        }
        const Route r = take_route(CollectiveKind::kAllGather, static_cast<int64_t>(s.nbytes()));
        all_gather_over(r, f, s,
                        ring_slot_base(seq, CollectiveKind::kAllGather, s.scalar_type(), -1));
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
                  const Route r =
                      take_route(CollectiveKind::kReduceScatter, static_cast<int64_t>(s.nbytes()));
                  if (r == Route::kShm) return shm_->reduce_scatter(f, s, op);
                  at::Tensor scratch = size() >= 3 ? scratch_like(s) : at::Tensor();
                  const uint64_t base = ring_slot_base(seq, CollectiveKind::kReduceScatter,
                                                       s.scalar_type(), static_cast<int64_t>(op));
                  ring_reduce_scatter(ring_transport(r), rank(), size(), f, s, scratch, op, base,
                                      config_.ring_segment_bytes);
                });
}

Work GlooProcessGroup::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  check_single("all_reduce", tensor);
  return submit(CollectiveKind::kAllReduce, describe_tensor(tensor) + ", " + to_string(op),
                {tensor}, static_cast<int64_t>(op), [this, tensor, op](uint64_t seq) {
                  if (size() == 1 || tensor.numel() == 0) return;
                  const int64_t chunk = (tensor.numel() + size() - 1) / size() *
                                        static_cast<int64_t>(tensor.element_size());
                  const Route r = take_route(CollectiveKind::kAllReduce, chunk);
                  if (r == Route::kShm) return shm_->all_reduce(tensor, op);
                  ring_all_reduce(r, tensor, op, seq, CollectiveKind::kAllReduce);
                });
}

void GlooProcessGroup::ring_all_reduce(Route route, const at::Tensor& tensor, ReduceOp op,
                                       uint64_t seq, CollectiveKind kind) {
  // A reduce-scatter then an all-gather ring, on a copy padded to a multiple
  // of the group size (the padding is never read back).
  PointToPoint& p2p = ring_transport(route);
  const int64_t numel = tensor.numel(), per = (numel + size() - 1) / size();
  at::Tensor flat = at::zeros({per * size()}, tensor.options());
  flat.narrow(0, 0, numel).copy_(tensor.view({-1}));
  at::Tensor shard = at::empty({per}, tensor.options());
  at::Tensor scratch = size() >= 3 ? scratch_like(shard) : at::Tensor();
  const uint64_t base = ring_slot_base(seq, kind, tensor.scalar_type(), static_cast<int64_t>(op));
  const int64_t segment = config_.ring_segment_bytes;
  ring_reduce_scatter(p2p, rank(), size(), flat, shard, scratch, op, base, segment);
  ring_all_gather(p2p, rank(), size(), flat, shard, base + (uint64_t{1} << 20), segment);
  tensor.view({-1}).copy_(flat.narrow(0, 0, numel));
}

Work GlooProcessGroup::broadcast(const at::Tensor& tensor, int root) {
  check_single("broadcast", tensor);
  check_root(root);
  return submit(
      CollectiveKind::kBroadcast, describe_tensor(tensor) + ", root " + std::to_string(root),
      {tensor}, root, [this, tensor, root](uint64_t seq) {
        if (size() == 1 || tensor.numel() == 0) return;
        const auto bytes = static_cast<int64_t>(tensor.nbytes());
        const Route r = take_route(CollectiveKind::kBroadcast, bytes);
        ring_broadcast(ring_transport(r), rank(), size(), tensor.view({-1}), root,
                       ring_slot_base(seq, CollectiveKind::kBroadcast, tensor.scalar_type(), root),
                       config_.ring_segment_bytes);
      });
}

Work GlooProcessGroup::barrier() {
  return submit(CollectiveKind::kBarrier, "", {}, -1, [this](uint64_t seq) {
    if (size() == 1) return;
    const Route r = take_route(CollectiveKind::kBarrier, 0);
    at::Tensor token = at::zeros({1}, at::kFloat);
    ring_all_reduce(r, token, ReduceOp::kSum, seq, CollectiveKind::kBarrier);
  });
}

std::shared_ptr<ProcessGroup> GlooProcessGroup::new_subgroup(const std::vector<int>& ranks) {
  check_subgroup_ranks(ranks);
  const std::string prefix = prefix_ + "/sub" + std::to_string(subgroups_made_++);
  auto it = std::find(ranks.begin(), ranks.end(), rank());
  if (it == ranks.end()) return nullptr;
  const int sub_rank = static_cast<int>(it - ranks.begin());
  auto sub = std::make_shared<GlooProcessGroup>(
      store_, prefix, sub_rank, static_cast<int>(ranks.size()), timeout(), listen_addr_, config_);
  sub->set_debug_collectives(debug_collectives());
  if (sub->size() > 1) sub->barrier().wait();  // everyone connected before use
  return sub;
}

}  // namespace fsdp::detail
