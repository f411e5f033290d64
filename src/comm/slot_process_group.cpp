#include "comm/slot_process_group.h"

#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <atomic>
#include <functional>
#include <utility>
#include <vector>

#include "comm/comm_thread.h"
#include "detail/error.h"

namespace fsdp::detail {

namespace {

class SlotProcessGroup final : public ProcessGroup {
 public:
  SlotProcessGroup(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                   std::chrono::milliseconds timeout, int64_t slot_bytes, SlotOpener open_slots,
                   std::string name, std::unique_ptr<ShmLinks> links)
      : ProcessGroup(rank, size, timeout),
        store_(std::move(store)),
        slot_bytes_(slot_bytes),
        open_slots_(std::move(open_slots)),
        name_(std::move(name)),
        links_(std::move(links)),
        thread_(std::make_unique<CommThread>(rank, timeout)) {}
  // The queue is finished before the slots it uses go.
  ~SlotProcessGroup() override { thread_.reset(); }

  std::string backend_name() const override { return name_; }

  Work all_gather_into_tensor(const at::Tensor& flat, const at::Tensor& shard) override {
    check_all_gather(flat, shard);
    check_device("all_gather", flat);
    return submit(CollectiveKind::kAllGather, describe_tensor(flat), {flat, shard}, -1,
                  [this, flat, shard] { links_->all_gather(flat.view(-1), shard.view(-1)); });
  }

  Work reduce_scatter_tensor(const at::Tensor& shard, const at::Tensor& flat,
                             ReduceOp op) override {
    check_reduce_scatter(shard, flat, op);
    check_device("reduce_scatter", flat);
    return submit(CollectiveKind::kReduceScatter, describe_tensor(flat) + ", " + to_string(op),
                  {shard, flat}, static_cast<int64_t>(op), [this, flat, shard, op] {
                    links_->reduce_scatter(flat.view(-1), shard.view(-1), op);
                  });
  }

  Work all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    check_single("all_reduce", tensor);
    check_device("all_reduce", tensor);
    return submit(CollectiveKind::kAllReduce, describe_tensor(tensor) + ", " + to_string(op),
                  {tensor}, static_cast<int64_t>(op),
                  [this, tensor, op] { links_->all_reduce(tensor, op); });
  }

  Work broadcast(const at::Tensor& tensor, int root) override {
    check_single("broadcast", tensor);
    check_root(root);
    check_device("broadcast", tensor);
    return submit(CollectiveKind::kBroadcast,
                  describe_tensor(tensor) + ", root " + std::to_string(root), {tensor}, root,
                  [this, tensor, root] { links_->broadcast(tensor, root); });
  }

  // A one-element all-reduce: every rank has issued it once it completes.
  Work barrier() override {
    at::Tensor one = at::zeros({1}, at::TensorOptions().device(links_->slots().device()));
    return submit(CollectiveKind::kBarrier, "", {one}, -1,
                  [this, one] { links_->all_reduce(one, ReduceOp::kSum); });
  }

  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks) override {
    check_subgroup_ranks(ranks);
    const std::string prefix = name_ + "_sub" + std::to_string(subgroups_made_++);
    auto it = std::find(ranks.begin(), ranks.end(), rank());
    if (it == ranks.end()) return nullptr;
    auto sub = make_slot_group(c10::make_intrusive<c10d::PrefixStore>(prefix, store_),
                               static_cast<int>(it - ranks.begin()), static_cast<int>(ranks.size()),
                               timeout(), slot_bytes_, open_slots_, name_);
    FSDP_CHECK(sub, rank(), "process group", "new_subgroup: the ", name_,
               " group's sub-group could not open its slots on every rank (a CUDA call failed "
               "on some rank: see its log)");
    return sub;
  }

 private:
  void check_device(const char* op, const at::Tensor& t) const {
    const c10::Device device = links_->slots().device();
    FSDP_CHECK(t.device() == device, rank(), "process group", op, ": the ", name_,
               " group carries tensors on ", device, ", got one on ", t.device(),
               ". Move it there first.");
  }

  // The body runs once what the issuing stream had queued has run
  // (SlotMemory::when_ready()).
  Work submit(CollectiveKind kind, const std::string& what, std::vector<at::Tensor> tensors,
              int64_t detail, std::function<void()> body) {
    auto run = links_->slots().when_ready();
    return thread_->enqueue(
        kind, what.empty() ? name_ : what + ", " + name_, std::move(tensors), detail,
        [run = std::move(run), body = std::move(body)](uint64_t) { run(body); });
  }

  const c10::intrusive_ptr<c10d::Store> store_;
  const int64_t slot_bytes_;
  const SlotOpener open_slots_;
  const std::string name_;
  std::unique_ptr<ShmLinks> links_;
  std::unique_ptr<CommThread> thread_;  // after links_: destroyed first
  std::atomic<int> subgroups_made_{0};
};

}  // namespace

std::shared_ptr<ProcessGroup> make_slot_group(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int size, std::chrono::milliseconds timeout,
                                              int64_t slot_bytes, SlotOpener open_slots,
                                              std::string name) {
  auto links = ShmLinks::connect(*store, rank, size, timeout, true, slot_bytes, open_slots);
  if (!links) return nullptr;
  return std::make_shared<SlotProcessGroup>(store, rank, size, timeout, slot_bytes,
                                            std::move(open_slots), std::move(name),
                                            std::move(links));
}

}  // namespace fsdp::detail
