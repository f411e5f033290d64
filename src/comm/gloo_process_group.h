#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>

#include <fsdp/comm/process_group.h>

namespace fsdp::detail {

class CommThread;

class DirectLinks;
class GlooEngine;
class PointToPoint;
class ShmLinks;

/// The CPU engine, on one communication thread per group: small collectives
/// over direct links, large ones over shared memory when every rank is on
/// this host (Note [Shared memory for same-host ranks]), the rest over Gloo
/// where built with it, else over the direct links (Note [Gloo or not],
/// Note [Routes of collectives]).
class GlooProcessGroup final : public ProcessGroup {
 public:
  /// Connects a full mesh of `size` ranks through `store` (keys under
  /// `prefix`), listening on `listen_addr`. Size 1 opens nothing and runs
  /// every collective inline.
  GlooProcessGroup(c10::intrusive_ptr<c10d::Store> store, const std::string& prefix, int rank,
                   int size, std::chrono::milliseconds timeout, std::string listen_addr);
  ~GlooProcessGroup() override;

  std::string backend_name() const override;
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
  enum class Route : uint8_t { kLinks, kShm, kGloo };
  // The route of a collective of `kind` over `bytes` (per-rank chunk for
  // all-gather and reduce-scatter, the whole tensor for all-reduce). See Note
  // [Routes of collectives].
  Route route(CollectiveKind kind, int64_t bytes) const;
  // What a ring collective with per-rank chunks of `chunk_bytes` runs on.
  PointToPoint& ring_transport(size_t chunk_bytes);
  // all_reduce as reduce-scatter + all-gather rings over the direct links.
  void ring_all_reduce_over_links(const at::Tensor& tensor, ReduceOp op, uint64_t seq);

  // Constant after construction.
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  std::string listen_addr_;
  // Gloo's mesh; null when size() == 1 or built without Gloo.
  std::unique_ptr<GlooEngine> gloo_;
  // Small collectives' transport (Note [Direct links for small collectives]),
  // and without Gloo every one shared memory does not carry; null when
  // size() == 1, or turned off with Gloo there.
  std::unique_ptr<DirectLinks> links_;
  // Larger collectives' transport when every rank is on this host (Note
  // [Shared memory for same-host ranks]); null otherwise or when turned off.
  std::unique_ptr<ShmLinks> shm_;

  int subgroups_made_ = 0;  // caller thread only
  at::Tensor scratch_;      // communication thread only

  std::unique_ptr<CommThread> thread_;  // last: joined before the rest is destroyed
};

}  // namespace fsdp::detail
