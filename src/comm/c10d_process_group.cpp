#include <fsdp/comm/c10d_process_group.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <sstream>

#include "comm/comm_config.h"
#include "comm/comm_thread.h"
#include "comm/reduce.h"
#include "comm/ring.h"
#include "detail/error.h"
#include "detail/inference_mode.h"
#include "detail/torch_compat.h"

namespace fsdp {

namespace {

class C10dTransfer : public detail::PendingTransfer {
 public:
  C10dTransfer(c10::intrusive_ptr<c10d::Work> work, std::chrono::milliseconds timeout)
      : work_(std::move(work)), timeout_(timeout) {}
  void wait() override { compat::wait_work(work_, timeout_); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::chrono::milliseconds timeout_;
};

// c10d tags are ints: the low 15 bits of the sequence number, then 16 bits of
// segment index (Note [Ring collectives] keeps a collective well below 2^16).
class C10dPointToPoint : public detail::PointToPoint {
 public:
  C10dPointToPoint(c10d::ProcessGroup& group, std::chrono::milliseconds timeout)
      : group_(group), timeout_(timeout) {}
  std::unique_ptr<detail::PendingTransfer> isend(const at::Tensor& src, int peer,
                                                 uint64_t slot) override {
    std::vector<at::Tensor> tensors{src};
    return std::make_unique<C10dTransfer>(group_.send(tensors, peer, tag(slot)), timeout_);
  }
  std::unique_ptr<detail::PendingTransfer> irecv(const at::Tensor& dst, int peer,
                                                 uint64_t slot) override {
    std::vector<at::Tensor> tensors{dst};
    return std::make_unique<C10dTransfer>(group_.recv(tensors, peer, tag(slot)), timeout_);
  }
  static uint64_t slot_base(uint64_t seq) { return (seq & 0x7fffu) << 16; }
  // Fingerprints (Note [Collective fingerprints]) use the top segment
  // indices of their collective's tag range, which no collective reaches.
  static uint64_t fingerprint_slot_base(uint64_t seq) { return slot_base(seq) | 0xf000u; }

 private:
  static int tag(uint64_t slot) { return static_cast<int>(slot & 0x7fffffffu); }
  c10d::ProcessGroup& group_;
  std::chrono::milliseconds timeout_;
};

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    default:
      return c10d::ReduceOp::SUM;  // avg: sum, then divide (Gloo has no AVG)
  }
}

// c10d's Gloo (1.13) has no bfloat16 reductions; such tensors travel as
// float32 and are rounded back once, after the reduction.
bool needs_float_detour(c10d::ProcessGroup& group, const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 && group.getBackendName() == "gloo";
}

}  // namespace

C10dProcessGroup::C10dProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                   std::chrono::milliseconds timeout,
                                   c10::intrusive_ptr<c10d::Store> store, C10dGroupFactory factory)
    : ProcessGroup(group->getRank(), group->getSize(), timeout),
      group_(std::move(group)),
      store_(std::move(store)),
      factory_(std::move(factory)),
      thread_(std::make_unique<detail::CommThread>(rank(), timeout)) {
  thread_->set_fingerprint_exchange(
      [this](const at::Tensor& mine, uint64_t seq) { return exchange_fingerprints(mine, seq); });
  set_debug_collectives(detail::debug_requested_by_env());
}

void C10dProcessGroup::set_debug_collectives(bool on) { thread_->set_debug(on && size() > 1); }

bool C10dProcessGroup::debug_collectives() const { return thread_->debug(); }

at::Tensor C10dProcessGroup::exchange_fingerprints(const at::Tensor& mine, uint64_t seq) {
  at::Tensor all = at::empty({size() * mine.numel()}, mine.options());
  C10dPointToPoint p2p(*group_, timeout());
  detail::ring_all_gather(p2p, rank(), size(), all, mine,
                          C10dPointToPoint::fingerprint_slot_base(seq),
                          detail::kDefaultRingSegmentBytes);
  return all.view({size(), mine.numel()});
}

C10dProcessGroup::~C10dProcessGroup() { thread_.reset(); }

void C10dProcessGroup::check_carried(const char* op, const at::Tensor& tensor) const {
  // Every rank issues the same collectives, so every rank fails here alike.
  FSDP_CHECK(!tensor.is_cpu() || group_->getBackendName() != "nccl", rank(), "process group", op,
             ": this C10dProcessGroup wraps a c10d NCCL group, which carries CUDA tensors "
             "only, and libfsdp also sends small CPU tensors between ranks (agreements, "
             "checkpoints). Use fsdp::init_process_group() instead: it drives NCCL for CUDA "
             "tensors and its own transport for CPU tensors.");
}

std::string C10dProcessGroup::backend_name() const { return "c10d:" + group_->getBackendName(); }

Work C10dProcessGroup::all_gather_into_tensor(const at::Tensor& flat, const at::Tensor& shard) {
  check_all_gather(flat, shard);
  check_carried("all_gather", shard);
  return thread_->enqueue(CollectiveKind::kAllGather, detail::describe_tensor(flat), {flat, shard},
                          -1, [this, flat, shard](uint64_t seq) {
                            C10dPointToPoint p2p(*group_, timeout());
                            detail::ring_all_gather(
                                p2p, rank(), size(), flat.view({-1}), shard.view({-1}),
                                C10dPointToPoint::slot_base(seq), detail::kDefaultRingSegmentBytes);
                          });
}

Work C10dProcessGroup::reduce_scatter_tensor(const at::Tensor& shard, const at::Tensor& flat,
                                             ReduceOp op) {
  check_reduce_scatter(shard, flat, op);
  check_carried("reduce_scatter", flat);
  return thread_->enqueue(CollectiveKind::kReduceScatter,
                          detail::describe_tensor(flat) + ", " + to_string(op), {flat, shard},
                          static_cast<int64_t>(op), [this, flat, shard, op](uint64_t seq) {
                            const at::Tensor s = shard.view({-1});
                            at::Tensor scratch;
                            if (size() >= 3) {
                              if (!scratch_.defined() || scratch_.numel() < s.numel() ||
                                  scratch_.scalar_type() != s.scalar_type()) {
                                // Kept: a normal tensor (Note [Inference mode]).
                                const detail::OutsideInferenceMode outside;
                                scratch_ = at::empty({s.numel()}, s.options());
                              }
                              scratch = scratch_.narrow(0, 0, s.numel());
                            }
                            C10dPointToPoint p2p(*group_, timeout());
                            detail::ring_reduce_scatter(
                                p2p, rank(), size(), flat.view({-1}), s, scratch, op,
                                C10dPointToPoint::slot_base(seq), detail::kDefaultRingSegmentBytes);
                          });
}

Work C10dProcessGroup::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  check_single("all_reduce", tensor);
  check_carried("all_reduce", tensor);
  return thread_->enqueue(
      CollectiveKind::kAllReduce, detail::describe_tensor(tensor) + ", " + to_string(op), {tensor},
      static_cast<int64_t>(op), [this, tensor, op](uint64_t) {
        const bool detour = needs_float_detour(*group_, tensor);
        std::vector<at::Tensor> tensors{detour ? tensor.to(at::kFloat) : tensor};
        c10d::AllreduceOptions opts;
        opts.reduceOp = to_c10d(op);
        compat::wait_work(group_->allreduce(tensors, opts), timeout());
        if (detour) tensor.copy_(tensors[0]);
        detail::finish_reduction(tensor, op, size());  // c10d's combining, our avg
      });
}

Work C10dProcessGroup::broadcast(const at::Tensor& tensor, int root) {
  check_single("broadcast", tensor);
  check_carried("broadcast", tensor);
  check_root(root);
  return thread_->enqueue(
      CollectiveKind::kBroadcast,
      detail::describe_tensor(tensor) + ", root " + std::to_string(root), {tensor}, root,
      [this, tensor, root](uint64_t) {
        const bool detour = needs_float_detour(*group_, tensor);
        std::vector<at::Tensor> tensors{detour ? tensor.to(at::kFloat) : tensor};
        c10d::BroadcastOptions opts;
        opts.rootRank = root;
        compat::wait_work(group_->broadcast(tensors, opts), timeout());
        if (detour) tensor.copy_(tensors[0]);
      });
}

Work C10dProcessGroup::barrier() {
  return thread_->enqueue(CollectiveKind::kBarrier, "", {}, -1,
                          [this](uint64_t) { compat::wait_work(group_->barrier(), timeout()); });
}

std::shared_ptr<ProcessGroup> C10dProcessGroup::new_subgroup(const std::vector<int>& ranks) {
  check_subgroup_ranks(ranks);
  FSDP_CHECK(store_ && factory_, rank(), "process group",
             "new_subgroup: this C10dProcessGroup was built without a store and a "
             "group factory; pass both to its constructor to make sub-groups");
  const std::string prefix = "c10d_sub" + std::to_string(subgroups_made_++);
  auto it = std::find(ranks.begin(), ranks.end(), rank());
  if (it == ranks.end()) return nullptr;
  auto sub_store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
  const int sub_rank = static_cast<int>(it - ranks.begin());
  auto sub = factory_(sub_store, sub_rank, static_cast<int>(ranks.size()));
  auto group = std::make_shared<C10dProcessGroup>(sub, timeout(), sub_store, factory_);
  group->set_debug_collectives(debug_collectives());
  if (group->size() > 1) group->barrier().wait();  // everyone connected before use
  return group;
}

}  // namespace fsdp
