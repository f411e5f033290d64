#pragma once

// Note [Tensors on other devices than the engine's]
// The engine init_process_group makes (libfsdp's CPU engine, or c10d's Gloo)
// reads and writes tensors through host pointers; handed a CUDA tensor it
// would read device memory from the host. PyTorch routes each collective by
// the tensors' device ("cpu:gloo,cuda:nccl"); so does the group
// init_process_group returns: CPU tensors go to the engine untouched, and
// tensors on any other device are staged through host memory (pinned for
// CUDA, so that the copies run at the bus's rate): copied to the host when
// the collective is issued (which waits for the kernels that wrote them, on
// the caller's current stream), carried by the engine, and copied back by
// the thread that completes the collective before its Work completes. So a
// Work that completed means the result is in device memory, as for a CPU
// tensor, and every rank's group keeps one order of collectives. This is the
// transport of ranks that share one GPU (NCCL before 2.30 refuses them, and
// the GPU machines tested on have NCCL 2.28) and the reference every faster
// GPU path is tested against; the staging runs on any device LibTorch can
// copy from, so the CPU tests exercise it by staging CPU tensors too. Where
// NCCL can run (Note [Choosing what carries CUDA tensors]), CUDA tensors go
// to a NCCL group instead, the collectives staying in one order per group.

#include <memory>
#include <string>
#include <vector>

#include <fsdp/comm/process_group.h>

namespace fsdp::detail {

/// A group that carries CPU tensors on `host` and stages every other
/// device's tensors through host memory to it (Note [Tensors on other
/// devices than the engine's]).
class DeviceRoutedProcessGroup final : public ProcessGroup {
 public:
  /// Routes over `host`, and CUDA tensors over `cuda` when given (NCCL).
  /// With `stage_cpu_tensors`, CPU tensors are staged through host buffers
  /// of their own as well (tests of the staging).
  explicit DeviceRoutedProcessGroup(std::shared_ptr<ProcessGroup> host,
                                    bool stage_cpu_tensors = false,
                                    std::shared_ptr<ProcessGroup> cuda = nullptr);

  std::string backend_name() const override { return host_->backend_name(); }
  Work all_gather_into_tensor(const at::Tensor& flat, const at::Tensor& shard) override;
  Work reduce_scatter_tensor(const at::Tensor& shard, const at::Tensor& flat, ReduceOp op) override;
  Work all_reduce(const at::Tensor& tensor, ReduceOp op) override;
  Work broadcast(const at::Tensor& tensor, int root) override;
  Work barrier() override { return host_->barrier(); }
  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks) override;
  void set_debug_collectives(bool on) override { host_->set_debug_collectives(on); }
  bool debug_collectives() const override { return host_->debug_collectives(); }

  /// The engine that carries the collectives.
  const std::shared_ptr<ProcessGroup>& host_group() const { return host_; }
  /// The group that carries CUDA tensors (NCCL), or nullptr: staged.
  const std::shared_ptr<ProcessGroup>& cuda_group() const { return cuda_; }

 private:
  enum class Route { kHost, kStaged, kCuda };
  // Where the collective's tensors go; checks that they are on one device.
  Route route(const char* op, const at::Tensor& a, const at::Tensor& b) const;

  const std::shared_ptr<ProcessGroup> host_;
  const bool stage_cpu_tensors_;
  const std::shared_ptr<ProcessGroup> cuda_;
};

/// The engine behind a group init_process_group made (the group itself for
/// any other).
ProcessGroup& engine_of(ProcessGroup& group);

}  // namespace fsdp::detail
