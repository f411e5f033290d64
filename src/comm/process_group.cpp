#include <fsdp/comm/process_group.h>

#include <c10/util/Exception.h>

#include <algorithm>

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

ProcessGroup::ProcessGroup(int rank, int size, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), timeout_(timeout) {
  TORCH_CHECK(size >= 1, "fsdp: a process group needs at least one rank, got size ", size);
  TORCH_CHECK(rank >= 0 && rank < size, "fsdp: rank must be in [0, ", size, "), got ", rank);
  TORCH_CHECK(timeout.count() > 0, "fsdp: the collective timeout must be positive, got ",
              timeout.count(), " ms");
}

void ProcessGroup::set_debug_collectives(bool on) {
  TORCH_CHECK(!on, "[rank ", rank_, "] fsdp: the ", backend_name(),
              " process group has no debug mode (collective fingerprints)");
}

void ProcessGroup::check_single(const char* op_name, const at::Tensor& t) const {
  TORCH_CHECK(t.defined(), "[rank ", rank_, "] fsdp ", op_name, ": got an undefined tensor");
  TORCH_CHECK(t.is_contiguous(), "[rank ", rank_, "] fsdp ", op_name,
              ": expected a contiguous tensor, got sizes ", t.sizes(), " strides ", t.strides(),
              ". Call .contiguous() first.");
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
              "[rank ", rank_, "] fsdp ", op_name,
              ": supported dtypes are float32, float64, bfloat16 and float16, got ", dt);
}

void ProcessGroup::check_all_gather(const at::Tensor& flat, const at::Tensor& shard) const {
  check_single("all_gather", flat);
  check_single("all_gather", shard);
  TORCH_CHECK(flat.scalar_type() == shard.scalar_type(), "[rank ", rank_,
              "] fsdp all_gather: the flat buffer is ", flat.scalar_type(), " but the shard is ",
              shard.scalar_type(), "; they must have the same dtype");
  TORCH_CHECK(flat.numel() == shard.numel() * size_, "[rank ", rank_,
              "] fsdp all_gather: expected a flat buffer of world size ", size_, " x shard numel ",
              shard.numel(), " = ", shard.numel() * size_, " elements, got ", flat.numel(),
              ". Pad the flat buffer to a multiple of the world size.");
}

void ProcessGroup::check_reduce_scatter(const at::Tensor& shard, const at::Tensor& flat,
                                        ReduceOp op) const {
  check_single("reduce_scatter", flat);
  check_single("reduce_scatter", shard);
  TORCH_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, "[rank ", rank_,
              "] fsdp reduce_scatter: supports sum and avg, got ", to_string(op));
  TORCH_CHECK(flat.scalar_type() == shard.scalar_type(), "[rank ", rank_,
              "] fsdp reduce_scatter: the flat buffer is ", flat.scalar_type(),
              " but the shard is ", shard.scalar_type(), "; they must have the same dtype");
  TORCH_CHECK(flat.numel() % size_ == 0, "[rank ", rank_, "] fsdp reduce_scatter: the flat ",
              "buffer has ", flat.numel(), " elements, which is not divisible by the world size ",
              size_, ". Pad it to a multiple of the world size (",
              (flat.numel() / size_ + 1) * size_, " elements).");
  TORCH_CHECK(shard.numel() * size_ == flat.numel(), "[rank ", rank_,
              "] fsdp reduce_scatter: expected a shard of flat numel ", flat.numel(),
              " / world size ", size_, " = ", flat.numel() / size_, " elements, got ",
              shard.numel());
  TORCH_CHECK(!shard.is_same(flat), "[rank ", rank_,
              "] fsdp reduce_scatter: the shard must not be the flat buffer itself");
}

void ProcessGroup::check_root(int root) const {
  TORCH_CHECK(root >= 0 && root < size_, "[rank ", rank_, "] fsdp broadcast: root must be in [0, ",
              size_, "), got ", root);
}

void ProcessGroup::check_subgroup_ranks(const std::vector<int>& ranks) const {
  TORCH_CHECK(!ranks.empty(), "[rank ", rank_, "] fsdp new_subgroup: the rank list is empty");
  TORCH_CHECK(std::is_sorted(ranks.begin(), ranks.end()) &&
                  std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end(),
              "[rank ", rank_, "] fsdp new_subgroup: ranks must be sorted and unique, got ", c10::Join(", ", ranks));
  TORCH_CHECK(ranks.front() >= 0 && ranks.back() < size_, "[rank ", rank_,
              "] fsdp new_subgroup: ranks must be in [0, ", size_, "), got ",
              c10::Join(", ", ranks));
}

std::shared_ptr<ProcessGroup> new_node_subgroup(ProcessGroup& group, int local_world_size) {
  TORCH_CHECK(local_world_size >= 1 && group.size() % local_world_size == 0, "[rank ", group.rank(),
              "] fsdp new_node_subgroup: world size ", group.size(),
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

}  // namespace fsdp
