#include <fsdp/comm/process_group.h>

#include <ATen/MemoryOverlap.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "comm/agreement.h"
#include "comm/hybrid_subgroups.h"
#include "detail/error.h"

// Note [Flat buffers and shards]
// FSDP moves a unit's parameters as one *flat buffer* of world_size equal
// *shards*; rank r owns elements [r * S, (r + 1) * S). The unit pads the flat
// buffer to a multiple of world_size, so the collectives insist on an exact
// multiple: a remainder means a caller's bug, and silently dropping or
// padding elements here would corrupt parameters.

namespace fsdp {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

const char* to_string(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kBroadcast:
      return "broadcast";
    case CollectiveKind::kBarrier:
      return "barrier";
  }
  return "?";
}

namespace {

std::atomic<int64_t> g_multi_rank_groups{0};

}  // namespace

ProcessGroup::ProcessGroup(int rank, int size, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), timeout_(timeout) {
  FSDP_CHECK(size >= 1, -1, "process group", "a process group needs at least one rank, got size ",
             size);
  FSDP_CHECK(rank >= 0 && rank < size, -1, "process group", "rank must be in [0, ", size, "), got ",
             rank);
  FSDP_CHECK(timeout.count() > 0, rank, "process group",
             "the collective timeout must be positive, got ", timeout.count(), " ms");
  if (size > 1) ++g_multi_rank_groups;
}

ProcessGroup::~ProcessGroup() {
  if (size_ > 1) --g_multi_rank_groups;
}

namespace detail {

int64_t multi_rank_groups_alive() { return g_multi_rank_groups.load(); }

}  // namespace detail

void ProcessGroup::set_debug_collectives(bool on) {
  FSDP_CHECK(!on, rank_, "process group", "the ", backend_name(),
             " process group has no debug mode (collective fingerprints)");
}

void ProcessGroup::check_single(const char* op_name, const at::Tensor& t) const {
  FSDP_CHECK(t.defined(), rank_, "process group", op_name, ": got an undefined tensor");
  FSDP_CHECK(t.is_contiguous(), rank_, "process group", op_name,
             ": expected a contiguous tensor, got sizes ", t.sizes(), " strides ", t.strides(),
             ". Call .contiguous() first.");
  FSDP_CHECK(detail::collective_dtype(t.scalar_type()), rank_, "process group", op_name,
             ": supported dtypes are float32, float64, bfloat16 and float16, got ",
             t.scalar_type());
}

void ProcessGroup::check_all_gather(const at::Tensor& flat, const at::Tensor& shard) const {
  check_single("all_gather", flat);
  check_single("all_gather", shard);
  FSDP_CHECK(flat.scalar_type() == shard.scalar_type(), rank_, "process group",
             "all_gather: the flat buffer is ", flat.scalar_type(), " but the shard is ",
             shard.scalar_type(), "; they must have the same dtype");
  FSDP_CHECK(flat.numel() == shard.numel() * size_, rank_, "process group",
             "all_gather: expected a flat buffer of world size ", size_, " x shard numel ",
             shard.numel(), " = ", shard.numel() * size_, " elements, got ", flat.numel(),
             ". Pad the flat buffer to a multiple of the world size.");
}

void ProcessGroup::check_reduce_scatter(const at::Tensor& shard, const at::Tensor& flat,
                                        ReduceOp op) const {
  check_single("reduce_scatter", flat);
  check_single("reduce_scatter", shard);
  FSDP_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, rank_, "process group",
             "reduce_scatter: supports sum and avg, got ", to_string(op));
  FSDP_CHECK(flat.scalar_type() == shard.scalar_type(), rank_, "process group",
             "reduce_scatter: the flat buffer is ", flat.scalar_type(), " but the shard is ",
             shard.scalar_type(), "; they must have the same dtype");
  FSDP_CHECK(flat.numel() % size_ == 0, rank_, "process group", "reduce_scatter: the flat ",
             "buffer has ", flat.numel(), " elements, which is not divisible by the world size ",
             size_, ". Pad it to a multiple of the world size (",
             (flat.numel() / size_ + 1) * size_, " elements).");
  FSDP_CHECK(shard.numel() * size_ == flat.numel(), rank_, "process group",
             "reduce_scatter: expected a shard of flat numel ", flat.numel(), " / world size ",
             size_, " = ", flat.numel() / size_, " elements, got ", shard.numel());
  // A shard within the flat buffer would take the ring's partial sums over
  // this rank's own part before it is read.
  const at::MemOverlapStatus overlap = at::get_overlap_status(shard, flat);
  FSDP_CHECK(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
             rank_, "process group",
             "reduce_scatter: the shard overlaps the flat buffer it reduces (a view of it). "
             "Give the shard memory of its own.");
}

void ProcessGroup::check_root(int root) const {
  FSDP_CHECK(root >= 0 && root < size_, rank_, "process group", "broadcast: root must be in [0, ",
             size_, "), got ", root);
}

void ProcessGroup::check_subgroup_ranks(const std::vector<int>& ranks) const {
  FSDP_CHECK(!ranks.empty(), rank_, "process group", "new_subgroup: the rank list is empty");
  FSDP_CHECK(std::is_sorted(ranks.begin(), ranks.end()) &&
                 std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end(),
             rank_, "process group", "new_subgroup: ranks must be sorted and unique, got ",
             c10::Join(", ", ranks));
  FSDP_CHECK(ranks.front() >= 0 && ranks.back() < size_, rank_, "process group",
             "new_subgroup: ranks must be in [0, ", size_, "), got ", c10::Join(", ", ranks));
}

std::shared_ptr<ProcessGroup> new_node_subgroup(ProcessGroup& group, int local_world_size) {
  FSDP_CHECK(local_world_size >= 1 && group.size() % local_world_size == 0, group.rank(),
             "process group", "new_node_subgroup: world size ", group.size(),
             " is not a multiple of the ranks per node ", local_world_size);
  std::shared_ptr<ProcessGroup> mine;
  // Every rank creates every node's group in the same order (see new_subgroup).
  for (int node = 0; node < group.size() / local_world_size; ++node) {
    std::vector<int> ranks(local_world_size);
    for (int i = 0; i < local_world_size; ++i) ranks[i] = node * local_world_size + i;
    auto g = group.new_subgroup(ranks);
    if (g) mine = std::move(g);
  }
  return mine;
}

HybridGroups new_hybrid_groups(const std::shared_ptr<ProcessGroup>& world, int shard_size) {
  TORCH_INTERNAL_ASSERT(world, "fsdp: new_hybrid_groups needs a group");
  FSDP_CHECK(shard_size >= 1 && world->size() % shard_size == 0, world->rank(), "process group",
             "new_hybrid_groups: world size ", world->size(),
             " is not a multiple of the shard group size ", shard_size,
             ". HYBRID_SHARD shards within groups of equal size (a node): start the same "
             "number of ranks on every node, or pass FSDPOptions::hybrid_groups");
  // Ranks numbered node by node.
  std::vector<std::vector<int>> nodes(world->size() / shard_size);
  for (int rank = 0; rank < world->size(); ++rank) nodes[rank / shard_size].push_back(rank);
  return detail::hybrid_groups_of_nodes(world, nodes);
}

namespace detail {

HybridGroups hybrid_groups_of_nodes(const std::shared_ptr<ProcessGroup>& world,
                                    const std::vector<std::vector<int>>& nodes) {
  HybridGroups groups;
  groups.world = world;
  // Every rank creates every group in the same order (see new_subgroup).
  for (const std::vector<int>& ranks : nodes) {
    if (auto g = world->new_subgroup(ranks)) groups.shard = std::move(g);
  }
  for (size_t position = 0; position < nodes.front().size(); ++position) {
    std::vector<int> ranks;
    for (const std::vector<int>& on_node : nodes) ranks.push_back(on_node[position]);
    std::sort(ranks.begin(), ranks.end());
    if (auto g = world->new_subgroup(ranks)) groups.replicate = std::move(g);
  }
  return groups;
}

}  // namespace detail

}  // namespace fsdp
