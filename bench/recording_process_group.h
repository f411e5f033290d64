#pragma once

// A counting process group that can also record the collectives it forwards
// (kind, elements, dtype) and replay them later without any compute: the
// "communication only" time of a training step (bench_step --comm-only).

#include <ATen/ATen.h>

#include <memory>
#include <mutex>
#include <vector>

#include "comm/counting_process_group.h"

namespace bench {

/// Records while recording() is on; replay() issues the recorded sequence
/// again on the inner group's engine (through this wrapper) and waits.
class RecordingProcessGroup : public fsdp::CountingProcessGroup {
 public:
  using fsdp::CountingProcessGroup::CountingProcessGroup;

  /// Starts or stops recording (a new recording replaces the old one).
  void set_recording(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (on) ops_.clear();
    recording_ = on;
  }

  fsdp::Work all_gather_into_tensor(const at::Tensor& flat, const at::Tensor& shard) override {
    record(Kind::kAllGather, flat);
    return CountingProcessGroup::all_gather_into_tensor(flat, shard);
  }
  fsdp::Work reduce_scatter_tensor(const at::Tensor& shard, const at::Tensor& flat,
                                   fsdp::ReduceOp op) override {
    record(Kind::kReduceScatter, flat);
    return CountingProcessGroup::reduce_scatter_tensor(shard, flat, op);
  }
  fsdp::Work all_reduce(const at::Tensor& t, fsdp::ReduceOp op) override {
    record(Kind::kAllReduce, t);
    return CountingProcessGroup::all_reduce(t, op);
  }

  /// Allocates the buffers of the recorded collectives (once, untimed).
  void prepare_replay() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Op& op : ops_) {
      op.flat = at::zeros({op.numel}, at::TensorOptions().dtype(op.dtype));
      op.shard = at::zeros({op.numel / size()}, at::TensorOptions().dtype(op.dtype));
    }
  }
  /// Issues every recorded collective in order, then waits for all.
  void replay() {
    std::vector<fsdp::Work> works;
    for (const Op& op : ops_) {
      switch (op.kind) {
        case Kind::kAllGather:
          works.push_back(CountingProcessGroup::all_gather_into_tensor(op.flat, op.shard));
          break;
        case Kind::kReduceScatter:
          works.push_back(
              CountingProcessGroup::reduce_scatter_tensor(op.shard, op.flat, fsdp::ReduceOp::kAvg));
          break;
        case Kind::kAllReduce:
          works.push_back(CountingProcessGroup::all_reduce(op.flat, fsdp::ReduceOp::kSum));
          break;
      }
    }
    for (const auto& w : works) w.wait();
  }
  /// Number of collectives recorded.
  size_t recorded() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return ops_.size();
  }

 private:
  enum class Kind { kAllGather, kReduceScatter, kAllReduce };
  struct Op {
    Kind kind;
    int64_t numel;
    at::ScalarType dtype;
    at::Tensor flat, shard;
  };
  void record(Kind kind, const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (recording_) ops_.push_back({kind, t.numel(), t.scalar_type(), {}, {}});
  }

  mutable std::mutex mutex_;
  bool recording_ = false;
  std::vector<Op> ops_;
};

}  // namespace bench
