#include "comm/gloo_process_group.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <map>
#include <mutex>
#include <sstream>

#include <fsdp/error_message.h>

#include "comm/comm_thread.h"
#include "comm/direct_links.h"
#include "comm/ring.h"
#include "comm/shm_links.h"

namespace fsdp::detail {

namespace {

// Gloo's rendezvous over any c10d::Store (ours, or a user's).
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  explicit GlooStoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, std::vector<uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_->get(key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// One Gloo device (a listening socket and an event loop thread) per address,
// shared by every group of the process.
std::shared_ptr<gloo::transport::Device> device_for(const std::string& addr) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<gloo::transport::Device>> devices;
  std::lock_guard<std::mutex> lock(mutex);
  auto& dev = devices[addr];
  if (!dev) {
    gloo::transport::tcp::attr attr;
    attr.hostname = addr;
    dev = gloo::transport::tcp::CreateDevice(attr);
  }
  return dev;
}

// Our ring slots live under their own prefix byte, far from the slots Gloo's
// own algorithms build, and carry the collective's sequence number.
constexpr uint64_t kRingSlotPrefix = 0x40;
uint64_t ring_slot_base(uint64_t seq) {
  return (kRingSlotPrefix << 56) | ((seq & 0xffffffu) << 24);
}
// Fingerprints (Note [Collective fingerprints]) under a prefix of their own.
constexpr uint64_t kFingerprintSlotPrefix = 0x41;
uint64_t fingerprint_slot_base(uint64_t seq) {
  return (kFingerprintSlotPrefix << 56) | ((seq & 0xffffffu) << 24);
}

class GlooTransfer : public PendingTransfer {
 public:
  GlooTransfer(std::unique_ptr<gloo::transport::UnboundBuffer> buf, bool is_send,
               std::chrono::milliseconds timeout)
      : buf_(std::move(buf)), is_send_(is_send), timeout_(timeout) {}
  void wait() override {
    const bool ok = is_send_ ? buf_->waitSend(timeout_) : buf_->waitRecv(timeout_);
    TORCH_CHECK(ok, "gloo ", is_send_ ? "send" : "receive", " was aborted");
  }

 private:
  std::unique_ptr<gloo::transport::UnboundBuffer> buf_;
  bool is_send_;
  std::chrono::milliseconds timeout_;
};

class GlooPointToPoint : public PointToPoint {
 public:
  GlooPointToPoint(gloo::Context& ctx, std::chrono::milliseconds timeout)
      : ctx_(ctx), timeout_(timeout) {}
  std::unique_ptr<PendingTransfer> isend(const at::Tensor& src, int peer, uint64_t slot) override {
    auto buf = ctx_.createUnboundBuffer(src.data_ptr(), src.nbytes());
    buf->send(peer, slot);
    return std::make_unique<GlooTransfer>(std::move(buf), true, timeout_);
  }
  std::unique_ptr<PendingTransfer> irecv(const at::Tensor& dst, int peer, uint64_t slot) override {
    auto buf = ctx_.createUnboundBuffer(dst.data_ptr(), dst.nbytes());
    buf->recv(peer, slot);
    return std::make_unique<GlooTransfer>(std::move(buf), false, timeout_);
  }

 private:
  gloo::Context& ctx_;
  std::chrono::milliseconds timeout_;
};

template <typename T>
void reduce_sum(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<T*>(c);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(x[i] + y[i]);
}

template <typename T>
void reduce_max(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<T*>(c);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] < y[i] ? y[i] : x[i];
}

template <typename T>
void reduce_min(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<T*>(c);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = y[i] < x[i] ? y[i] : x[i];
}

template <typename T>
void gloo_all_reduce_typed(const std::shared_ptr<gloo::Context>& ctx, const at::Tensor& t,
                           ReduceOp op, uint32_t tag, std::chrono::milliseconds timeout) {
  gloo::AllreduceOptions opts(ctx);
  opts.setOutput(static_cast<T*>(t.data_ptr()), static_cast<size_t>(t.numel()));
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      opts.setReduceFunction(&reduce_sum<T>);
      break;
    case ReduceOp::kMax:
      opts.setReduceFunction(&reduce_max<T>);
      break;
    case ReduceOp::kMin:
      opts.setReduceFunction(&reduce_min<T>);
      break;
  }
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::allreduce(opts);
}

template <typename T>
void gloo_broadcast_typed(const std::shared_ptr<gloo::Context>& ctx, const at::Tensor& t, int root,
                          uint32_t tag, std::chrono::milliseconds timeout) {
  gloo::BroadcastOptions opts(ctx);
  opts.setOutput(static_cast<T*>(t.data_ptr()), static_cast<size_t>(t.numel()));
  opts.setRoot(root);
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::broadcast(opts);
}

// Calls fn.template operator()<T>() for the C++ type of `dtype`.
template <typename Fn>
void dispatch_dtype(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat:
      return fn(float{});
    case at::kDouble:
      return fn(double{});
    case at::kBFloat16:
      return fn(c10::BFloat16{});
    case at::kHalf:
      return fn(c10::Half{});
    default:
      TORCH_INTERNAL_ASSERT(false, "unchecked dtype ", dtype);
  }
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
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->setTimeout(timeout);
    GlooStoreAdapter gstore(c10::make_intrusive<c10d::PrefixStore>(prefix_, store_));
    auto dev = device_for(listen_addr_);
    try {
      ctx->connectFullMesh(gstore, dev);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "[rank ", rank, "] fsdp: connecting the ", size, " ranks of group '",
                  prefix_, "' over Gloo (listening on ", listen_addr_, ") failed: ", error_message(e),
                  ". Check that every rank started and can reach the others' addresses.");
    }
    context_ = ctx;
    c10d::PrefixStore group_store(prefix_, store_);
    if (DirectLinks::max_message_bytes() > 0) {
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
  GlooPointToPoint gloo(*context_, timeout());
  ring_all_gather(transport_for(mine, gloo), rank(), size(), all, mine, fingerprint_slot_base(seq));
  return all.view({size(), mine.numel()});
}

GlooProcessGroup::~GlooProcessGroup() { thread_.reset(); }

Work GlooProcessGroup::submit(CollectiveKind kind, const std::string& what,
                              std::vector<at::Tensor> tensors, int64_t detail,
                              std::function<void(uint64_t seq)> body) {
  if (size() == 1) return thread_->run_inline(kind, what, std::move(tensors), detail, body);
  return thread_->enqueue(kind, what, std::move(tensors), detail, std::move(body));
}

PointToPoint& GlooProcessGroup::transport_for(const at::Tensor& shard, PointToPoint& gloo) {
  const bool small = static_cast<int64_t>(shard.nbytes()) <= DirectLinks::max_message_bytes();
  return links_ && small ? static_cast<PointToPoint&>(*links_) : gloo;
}

bool GlooProcessGroup::use_shm(int64_t chunk_bytes) const {
  return shm_ && (!links_ || chunk_bytes > DirectLinks::max_message_bytes());
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
                  if (use_shm(static_cast<int64_t>(s.nbytes()))) return shm_->all_gather(f, s);
                  GlooPointToPoint gloo(*context_, timeout());
                  ring_all_gather(transport_for(s, gloo), rank(), size(), f, s,
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
                  if (use_shm(static_cast<int64_t>(s.nbytes()))) {
                    return shm_->reduce_scatter(f, s, op);
                  }
                  at::Tensor scratch = size() >= 3 ? scratch_like(s) : at::Tensor();
                  GlooPointToPoint gloo(*context_, timeout());
                  ring_reduce_scatter(transport_for(s, gloo), rank(), size(), f, s, scratch, op,
                                      ring_slot_base(seq));
                });
}

Work GlooProcessGroup::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  check_single("all_reduce", tensor);
  return submit(
      CollectiveKind::kAllReduce, describe_tensor(tensor) + ", " + to_string(op), {tensor},
      static_cast<int64_t>(op), [this, tensor, op](uint64_t seq) {
        if (size() == 1 || tensor.numel() == 0) return;
        if (links_ &&
            static_cast<int64_t>(tensor.nbytes()) <= DirectLinks::max_message_bytes() * size()) {
          ring_all_reduce_small(tensor, op, seq);
          return;
        }
        if (shm_) return shm_->all_reduce(tensor, op);
        dispatch_dtype(tensor.scalar_type(), [&](auto tag_value) {
          using T = decltype(tag_value);
          gloo_all_reduce_typed<T>(context_, tensor, op, static_cast<uint32_t>(seq), timeout());
        });
        if (op == ReduceOp::kAvg) tensor.div_(size());
      });
}

void GlooProcessGroup::ring_all_reduce_small(const at::Tensor& tensor, ReduceOp op, uint64_t seq) {
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
        dispatch_dtype(tensor.scalar_type(), [&](auto tag_value) {
          using T = decltype(tag_value);
          gloo_broadcast_typed<T>(context_, tensor, root, static_cast<uint32_t>(seq), timeout());
        });
      });
}

Work GlooProcessGroup::barrier() {
  return submit(CollectiveKind::kBarrier, "", {}, -1, [this](uint64_t seq) {
    if (size() == 1) return;
    gloo::BarrierOptions opts(context_);
    opts.setTag(static_cast<uint32_t>(seq));
    opts.setTimeout(timeout());
    gloo::barrier(opts);
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
