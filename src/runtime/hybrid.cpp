#include "runtime/hybrid.h"

#include <c10/util/Exception.h>

#include <memory>
#include <mutex>
#include <vector>

#include <fsdp/comm/init.h>

#include "detail/error.h"

namespace fsdp::detail {

// Note [Hybrid sharding]
// HYBRID_SHARD (and _HYBRID_SHARD_ZERO2) shard a unit within a node's group
// and keep one copy of the sharded state per node. Forward and backward
// gather inside the node only; a gradient is reduce-scattered inside the node
// (the shard of the node's average), then each shard is all-reduced with its
// replicas on the other nodes (kAvg: the job's average). The all-reduce is
// chained to the reduce-scatter (detail::chain_work): the communication
// thread that finishes the reduce-scatter issues it, so backward never waits
// in between, and since reduce-scatters finish in issue order, every rank
// issues the all-reduces in one order. Across nodes each step moves one
// all-reduce of a shard per unit: 2 (N-1)/N of 1/P of the parameters per
// rank for N nodes of P ranks, against FULL_SHARD's all-gathers and
// reduce-scatter of everything over the slowest link.
//
// What is whole-job and what is per node:
// - the shard group carries the all-gathers, the reduce-scatter and
//   clip_grad_norm_'s sum (replicas hold equal gradients: each counted once);
// - process_group (the world) carries the forward-order check, the backward
//   agreements, sync_module_states and checkpoints (a shard is saved by its
//   node-0 copy only, Note [State pieces]).
// The groups are made once per world group from the launch topology (ranks
// per node from rank_info()), or given as FSDPOptions::hybrid_groups.

namespace {

struct CachedGroups {
  std::weak_ptr<ProcessGroup> world;
  int shard_size = 0;
  std::weak_ptr<ProcessGroup> shard, replicate;
};

std::mutex g_mutex;
std::vector<CachedGroups> g_cache;

}  // namespace

HybridGroups resolve_hybrid_groups(const FSDPOptions& options) {
  const char* what = "HYBRID_SHARD";
  if (const auto& given = options.hybrid_groups()) {
    const int rank = given->world ? given->world->rank() : -1;
    FSDP_CHECK(given->world && given->shard && given->replicate, rank, what,
               "hybrid_groups needs its world, shard and replicate groups; make them with "
               "fsdp::new_hybrid_groups(world, ranks_per_node)");
    FSDP_CHECK(!options.process_group() || options.process_group() == given->world, rank, what,
               "process_group is not hybrid_groups' world. Leave process_group unset, or set "
               "it to the world group the hybrid groups were made from");
    FSDP_CHECK(given->shard->size() * given->replicate->size() == given->world->size(), rank, what,
               "hybrid_groups: shard group size ", given->shard->size(), " x replicate group size ",
               given->replicate->size(), " != world size ", given->world->size(),
               ". Every rank must be in one shard and one replicate group");
    return *given;
  }
  std::shared_ptr<ProcessGroup> world =
      options.process_group() ? options.process_group() : default_process_group();
  FSDP_CHECK(is_initialized() && rank_info().world_size == world->size(), world->rank(), what,
             "cannot tell the nodes of a group of ", world->size(),
             " ranks that is not the job's (init_process_group's). Make the groups with "
             "fsdp::new_hybrid_groups(group, ranks_per_node) and pass "
             "FSDPOptions().hybrid_groups(groups)");
  const int shard_size = rank_info().local_world_size;
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto it = g_cache.begin(); it != g_cache.end();) {
    auto w = it->world.lock();
    auto s = it->shard.lock();
    auto r = it->replicate.lock();
    if (!w || !s || !r) {
      it = g_cache.erase(it);  // every unit that used them is gone
      continue;
    }
    if (w == world && it->shard_size == shard_size) return {w, s, r};
    ++it;
  }
  HybridGroups groups = new_hybrid_groups(world, shard_size);
  g_cache.push_back({world, shard_size, groups.shard, groups.replicate});
  return groups;
}

}  // namespace fsdp::detail
