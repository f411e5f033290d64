#include "runtime/hybrid.h"

#include <c10/util/Exception.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <fsdp/comm/init.h>

#include "comm/agreement.h"
#include "comm/hybrid_subgroups.h"
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
// - the shard group carries the all-gathers and the reduce-scatter;
// - process_group (the world) carries the forward-order check, the backward
//   agreements, clip_grad_norm_'s sum (each replica's piece counted 1 /
//   replicas), sync_module_states and checkpoints (a shard is saved by its
//   node-0 copy only, Note [State pieces]).
// The groups are made once per world group from the launch topology (ranks
// per node from rank_info(), the same on every rank or an error on each), or
// given as FSDPOptions::hybrid_groups (each replicate group's ranks must
// hold one shard: checked once per unit, over the world).

namespace {

struct CachedGroups {
  std::weak_ptr<ProcessGroup> world;
  int shard_size = 0;
  std::weak_ptr<ProcessGroup> shard, replicate;
};

std::mutex g_mutex;
std::vector<CachedGroups> g_cache;

// Node groups of the ranks per node each rank was told (LOCAL_WORLD_SIZE):
// nodes of different sizes would make ranks build different subgroups and
// wait on one another until the timeout. The same error on every rank.
// Note [Hybrid groups follow the nodes]
// The shard groups are the launcher's nodes (RankInfo::node_rank: GROUP_RANK,
// SLURM_NODEID), not runs of consecutive ranks: srun --distribution=cyclic
// and mpirun --map-by node number ranks round the nodes, and consecutive
// ranks would make shard groups that span nodes (every gather crossing
// them) and replicate groups inside one, with nothing wrong to see but the
// speed. Where ranks are numbered node by node the groups are
// new_hybrid_groups'. Every rank gathers every rank's node and ranks per
// node, so all make the same groups in the same order.
HybridGroups groups_by_node(const std::shared_ptr<ProcessGroup>& world, int shard_size) {
  const int me = world->rank();
  const std::vector<int64_t> all = agree_gather(world.get(), {shard_size, rank_info().node_rank});
  std::map<int64_t, std::vector<int>> nodes;  // node -> its ranks, ascending
  for (size_t r = 0; r < all.size() / 2; ++r) {
    FSDP_CHECK(all[2 * r] == shard_size, me, "HYBRID_SHARD", "ranks per node differ: ", shard_size,
               " on rank ", me, ", ", all[2 * r], " on rank ", r,
               ". Its node groups need as many ranks on every node: start as many on each, or "
               "pass FSDPOptions().hybrid_groups(fsdp::new_hybrid_groups(world, n)) with n "
               "dividing every node's count");
    nodes[all[2 * r + 1]].push_back(static_cast<int>(r));
  }
  for (const auto& [node, ranks] : nodes) {
    FSDP_CHECK(static_cast<int>(ranks.size()) == shard_size, me, "HYBRID_SHARD",
               "the launcher puts ", ranks.size(), " ranks on node ", node,
               " (its node numbers: GROUP_RANK or SLURM_NODEID), not ", shard_size,
               " (its ranks per node). Make the launcher's layout consistent, or pass "
               "FSDPOptions().hybrid_groups(fsdp::new_hybrid_groups(world, n))");
  }
  std::vector<std::vector<int>> layout;
  for (auto& [node, ranks] : nodes) layout.push_back(std::move(ranks));
  return hybrid_groups_of_nodes(world, layout);
}

// Groups made by hand: every rank of a replicate group must hold the same
// shard (the same rank in its shard group of the same size), or its
// all-reduce averages unrelated pieces of the parameters. Agreed over the
// world, so every rank fails alike.
void check_replicas_hold_one_shard(const HybridGroups& groups) {
  const int mine = groups.shard->rank(), size = groups.shard->size();
  const std::vector<int64_t> replicas = agree_gather(groups.replicate.get(), {mine, size});
  bool fits = true;
  for (size_t i = 0; i < replicas.size(); i += 2) {
    fits = fits && replicas[i] == mine && replicas[i + 1] == size;
  }
  const bool all_fit = agree_reduce(groups.world.get(), {fits ? 0 : 1}, ReduceOp::kMax)[0] == 0;
  FSDP_CHECK(all_fit, groups.world->rank(), "HYBRID_SHARD",
             "hybrid_groups: a replicate group holds ranks at different places of their shard "
             "groups (this rank is ",
             mine, " of ", size, " in its shard group",
             fits ? "; another replicate group mixes them" : ", not so the rest of its replicas",
             "), so its all-reduce would average different pieces of the parameters. Make the "
             "groups with fsdp::new_hybrid_groups(world, ranks_per_node)");
}

}  // namespace

HybridGroups resolve_hybrid_groups(const FSDPOptions& options) {
  const char* what = "HYBRID_SHARD";
  if (const auto& given = options.hybrid_groups()) {
    FSDP_CHECK(given->world, -1, what,
               "hybrid_groups needs its world group; make the groups with "
               "fsdp::new_hybrid_groups(world, ranks_per_node)");
    const int rank = given->world->rank();
    // Each rank's own checks, agreed over the world before anything runs
    // over the shard or replicate groups: a rank outside a subgroup made for
    // some ranks only (new_subgroup gives it none) fails, and the others
    // with it at once instead of waiting in those groups until the timeout.
    std::string problem;
    if (!given->shard || !given->replicate) {
      problem =
          "hybrid_groups needs a shard and a replicate group on every rank (this rank got "
          "none: a subgroup made of some ranks only?); make them with "
          "fsdp::new_hybrid_groups(world, ranks_per_node)";
    } else if (options.process_group() && options.process_group() != given->world) {
      problem =
          "process_group is not hybrid_groups' world. Leave process_group unset, or set it "
          "to the world group the hybrid groups were made from";
    } else if (given->shard->size() * given->replicate->size() != given->world->size()) {
      problem = "hybrid_groups: shard group size " + std::to_string(given->shard->size()) +
                " x replicate group size " + std::to_string(given->replicate->size()) +
                " != world size " + std::to_string(given->world->size()) +
                ". Every rank must be in one shard and one replicate group";
    }
    const bool any = agree_reduce(given->world.get(), {problem.empty() ? 0 : 1}, ReduceOp::kMax)[0];
    FSDP_CHECK(!any, rank, what,
               problem.empty() ? "hybrid_groups are refused on another rank (its error says why); "
                                 "make them with fsdp::new_hybrid_groups(world, ranks_per_node)"
                               : problem);
    check_replicas_hold_one_shard(*given);
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
  HybridGroups groups = groups_by_node(world, shard_size);
  g_cache.push_back({world, shard_size, groups.shard, groups.replicate});
  return groups;
}

}  // namespace fsdp::detail
