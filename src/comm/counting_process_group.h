#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/comm/process_group.h>

namespace fsdp {

/// A process group that forwards every collective to `inner` and counts
/// them: calls per operation, bytes of the unsharded buffers all-gathered and
/// reduce-scattered, and the dtypes reduce-scattered. For measuring the
/// communication of a model (tests, benchmarks): pass it as
/// FSDPOptions::process_group.
class CountingProcessGroup : public ProcessGroup {
 public:
  /// Counts what goes through to `inner`.
  explicit CountingProcessGroup(std::shared_ptr<ProcessGroup> inner)
      : ProcessGroup(inner->rank(), inner->size(), inner->timeout()), inner_(std::move(inner)) {}

  std::string backend_name() const override { return "counting:" + inner_->backend_name(); }
  Work all_gather_into_tensor(const at::Tensor& flat, const at::Tensor& shard) override {
    ++all_gathers;
    gathered_bytes += bytes(flat);
    return inner_->all_gather_into_tensor(flat, shard);
  }
  Work reduce_scatter_tensor(const at::Tensor& shard, const at::Tensor& flat,
                             ReduceOp op) override {
    ++reduce_scatters;
    reduced_bytes += bytes(flat);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      reduced_dtypes_.push_back(flat.scalar_type());
    }
    return inner_->reduce_scatter_tensor(shard, flat, op);
  }
  Work all_reduce(const at::Tensor& t, ReduceOp op) override {
    ++all_reduces;
    all_reduced_bytes += bytes(t);
    return inner_->all_reduce(t, op);
  }
  Work broadcast(const at::Tensor& t, int root) override {
    ++broadcasts;
    return inner_->broadcast(t, root);
  }
  Work barrier() override { return inner_->barrier(); }
  void set_debug_collectives(bool on) override { inner_->set_debug_collectives(on); }
  bool debug_collectives() const override { return inner_->debug_collectives(); }
  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks) override {
    return inner_->new_subgroup(ranks);
  }

  /// The dtypes of every reduce-scatter so far, in order.
  std::vector<at::ScalarType> reduced_dtypes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return reduced_dtypes_;
  }

  /// Calls so far, per operation.
  std::atomic<int64_t> all_gathers{0}, reduce_scatters{0}, all_reduces{0}, broadcasts{0};
  /// Bytes of the (unsharded) buffers all-gathered into / reduce-scattered from.
  std::atomic<int64_t> gathered_bytes{0}, reduced_bytes{0};
  /// Bytes all-reduced.
  std::atomic<int64_t> all_reduced_bytes{0};

 private:
  static int64_t bytes(const at::Tensor& t) {
    return t.numel() * static_cast<int64_t>(t.element_size());
  }

  std::shared_ptr<ProcessGroup> inner_;
  mutable std::mutex mutex_;
  std::vector<at::ScalarType> reduced_dtypes_;
};

}  // namespace fsdp
