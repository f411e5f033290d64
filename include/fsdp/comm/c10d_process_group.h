#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <memory>
#include <string>

#include <fsdp/comm/process_group.h>

namespace fsdp {

namespace detail {
class CommThread;
}  // namespace detail

/// Makes a c10d group of `size` ranks over `store`; used for sub-groups.
using C10dGroupFactory = std::function<c10::intrusive_ptr<c10d::ProcessGroup>(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size)>;

/// Adapts a c10d::ProcessGroup (ProcessGroupGloo) to fsdp::ProcessGroup.
/// All-gather and reduce-scatter are rings of c10d send/recv straight into
/// the caller's buffers, since c10d's own forms copy through temporaries on
/// CPU. A c10d NCCL group carries CUDA tensors only, and libfsdp also sends
/// small CPU tensors between ranks: a CPU tensor on one is an error naming
/// fsdp::init_process_group(), which drives NCCL for CUDA tensors itself.
class C10dProcessGroup final : public ProcessGroup {
 public:
  /// Wraps `group`. `store` and `factory` are needed only by new_subgroup().
  /// Debug mode starts on when FSDP_DEBUG=detail (see set_debug_collectives()).
  C10dProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> group, std::chrono::milliseconds timeout,
                   c10::intrusive_ptr<c10d::Store> store = {}, C10dGroupFactory factory = {});
  ~C10dProcessGroup() override;

  std::string backend_name() const override;
  Work all_gather_into_tensor(const at::Tensor& flat, const at::Tensor& shard) override;
  Work reduce_scatter_tensor(const at::Tensor& shard, const at::Tensor& flat, ReduceOp op) override;
  Work all_reduce(const at::Tensor& tensor, ReduceOp op) override;
  Work broadcast(const at::Tensor& tensor, int root) override;
  Work barrier() override;
  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks) override;
  void set_debug_collectives(bool on) override;
  bool debug_collectives() const override;

  /// The wrapped c10d group.
  const c10::intrusive_ptr<c10d::ProcessGroup>& c10d_group() const { return group_; }

 private:
  at::Tensor exchange_fingerprints(const at::Tensor& mine, uint64_t seq);
  // Refuses a CPU tensor on a c10d NCCL group, naming `op`.
  void check_carried(const char* op, const at::Tensor& tensor) const;

  // Constant after construction.
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10::intrusive_ptr<c10d::Store> store_;
  C10dGroupFactory factory_;

  int subgroups_made_ = 0;                      // caller thread only
  at::Tensor scratch_;                          // communication thread only
  std::unique_ptr<detail::CommThread> thread_;  // last: joined first
};

}  // namespace fsdp
