#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>

#include <fsdp/comm/process_group.h>

namespace gloo {
class Context;
}  // namespace gloo

namespace fsdp::detail {

class CommThread;

class DirectLinks;
class PointToPoint;
class ShmLinks;

/// The CPU engine: Gloo called directly, ring collectives on Gloo's unbound
/// buffers (Note [Ring collectives]), on one communication thread per group;
/// small collectives over direct links, large ones over shared memory when
/// every rank is on this host (Note [Shared memory for same-host ranks]).
class GlooProcessGroup final : public ProcessGroup {
 public:
  /// Connects a full mesh of `size` ranks through `store` (keys under
  /// `prefix`), listening on `listen_addr`. Size 1 opens nothing and runs
  /// every collective inline.
  GlooProcessGroup(c10::intrusive_ptr<c10d::Store> store, const std::string& prefix, int rank,
                   int size, std::chrono::milliseconds timeout, std::string listen_addr);
  ~GlooProcessGroup() override;

  std::string backend_name() const override { return size() == 1 ? "local" : "gloo"; }
  Work all_gather_into_tensor(const at::Tensor& flat, const at::Tensor& shard) override;
  Work reduce_scatter_tensor(const at::Tensor& shard, const at::Tensor& flat, ReduceOp op) override;
  Work all_reduce(const at::Tensor& tensor, ReduceOp op) override;
  Work broadcast(const at::Tensor& tensor, int root) override;
  Work barrier() override;
  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks) override;
  void set_debug_collectives(bool on) override;
  bool debug_collectives() const override;

 private:
  Work submit(CollectiveKind kind, const std::string& what, std::vector<at::Tensor> tensors,
              int64_t detail, std::function<void(uint64_t seq)> body);
  at::Tensor exchange_fingerprints(const at::Tensor& mine, uint64_t seq);
  at::Tensor scratch_like(const at::Tensor& shard);
  // The direct links for a collective whose per-rank chunk is `shard`, when
  // small enough; otherwise `gloo`.
  PointToPoint& transport_for(const at::Tensor& shard, PointToPoint& gloo);
  // all_reduce of a small tensor over the direct links (sequence `seq`).
  void ring_all_reduce_small(const at::Tensor& tensor, ReduceOp op, uint64_t seq);
  // True when a collective whose per-rank chunk is `chunk_bytes` goes
  // through shared memory (larger than what direct links carry).
  bool use_shm(int64_t chunk_bytes) const;

  // Constant after construction.
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  std::string listen_addr_;
  std::shared_ptr<gloo::Context> context_;  // null when size() == 1
  // Small collectives' transport (Note [Direct links for small collectives]);
  // null when size() == 1 or turned off.
  std::unique_ptr<DirectLinks> links_;
  // Larger collectives' transport when every rank is on this host (Note
  // [Shared memory for same-host ranks]); null otherwise or when turned off.
  std::unique_ptr<ShmLinks> shm_;

  int subgroups_made_ = 0;  // caller thread only
  at::Tensor scratch_;      // communication thread only

  std::unique_ptr<CommThread> thread_;  // last: joined before the rest is destroyed
};

}  // namespace fsdp::detail
