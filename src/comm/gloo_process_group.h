#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <array>
#include <atomic>
#include <memory>
#include <string>

#include <fsdp/comm/process_group.h>

#include "comm/comm_config.h"

namespace fsdp::detail {

class CommThread;

class DirectLinks;
class GlooEngine;
class PointToPoint;
class ShmLinks;

/// The ways a collective of GlooProcessGroup can travel (Note [Routes of
/// collectives]).
enum class Route : uint8_t {
  /// Rings over the direct TCP links to the ring neighbours.
  kLinks,
  /// The group's shared-memory segment (every rank on this host).
  kShm,
  /// Gloo: rings over Gloo's pairs, broadcast and barrier included
  /// (LibTorch 1.13 builds only).
  kGloo,
};
/// Number of Route values.
constexpr size_t kRouteCount = 3;
/// Number of CollectiveKind values.
constexpr size_t kCollectiveKindCount = static_cast<size_t>(CollectiveKind::kBarrier) + 1;

/// "links", "shm" or "gloo", for messages.
const char* to_string(Route route);

/// The CPU engine, on one communication thread per group: small collectives
/// over direct links, large ones over shared memory when every rank is on
/// this host (Note [Shared memory for same-host ranks]), the rest over Gloo
/// where built with it, else over the direct links (Note [Gloo or not],
/// Note [Routes of collectives]).
class GlooProcessGroup final : public ProcessGroup {
 public:
  /// Connects a full mesh of `size` ranks through `store` (keys under
  /// `prefix`), listening on `listen_addr`, with the knobs in `config`. Size 1
  /// opens nothing and runs every collective inline.
  GlooProcessGroup(c10::intrusive_ptr<c10d::Store> store, const std::string& prefix, int rank,
                   int size, std::chrono::milliseconds timeout, std::string listen_addr,
                   const CommConfig& config);
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

  /// The route a collective of `kind` whose per-rank chunk is `chunk_bytes`
  /// takes in this group (Note [Routes of collectives]); the only place that
  /// decides. Not meaningful for size() == 1, where nothing travels.
  Route route(CollectiveKind kind, int64_t chunk_bytes) const;
  /// How many collectives of `kind` this group has run over `route` (for
  /// tests and diagnostics; fingerprint exchanges are not counted).
  uint64_t route_count(CollectiveKind kind, Route route) const;
  /// The knobs this group was made with.
  const CommConfig& config() const { return config_; }

 private:
  Work submit(CollectiveKind kind, const std::string& what, std::vector<at::Tensor> tensors,
              int64_t detail, std::function<void(uint64_t seq)> body);
  at::Tensor exchange_fingerprints(const at::Tensor& mine, uint64_t seq);
  at::Tensor scratch_like(const at::Tensor& shard);
  // route() for a collective about to run, counted in route_count().
  Route take_route(CollectiveKind kind, int64_t chunk_bytes);
  // The point-to-point transport of a ring on `route` (kLinks or kGloo).
  PointToPoint& ring_transport(Route route);
  // All-gather of 1-D `shard` into `flat` over `route`, under ring slots `base`.
  void all_gather_over(Route route, const at::Tensor& flat, const at::Tensor& shard, uint64_t base);
  // all_reduce as reduce-scatter + all-gather rings over `route` (kLinks or kGloo).
  void ring_all_reduce(Route route, const at::Tensor& tensor, ReduceOp op, uint64_t seq,
                       CollectiveKind kind);

  // Constant after construction.
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  std::string listen_addr_;
  CommConfig config_;
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
  // route_count(): written by whichever thread runs a collective, read by any.
  std::array<std::atomic<uint64_t>, kCollectiveKindCount * kRouteCount> route_counts_{};

  std::unique_ptr<CommThread> thread_;  // last: joined before the rest is destroyed
};

}  // namespace fsdp::detail
