#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/comm/types.h>
#include <fsdp/comm/work.h>

namespace fsdp {

/// A group of ranks and the collectives FSDP needs, all asynchronous.
///
/// Vocabulary (see Note [Flat buffers and shards] in src/comm/process_group.cpp):
/// a *flat buffer* holds `size()` equal *shards* back to back; rank r owns the
/// shard at element offset r * shard_numel. Every collective is issued by all
/// ranks of the group in the same order. Tensors must be contiguous, of dtype
/// float32, float64, bfloat16 or float16, all of one collective on one device:
/// the groups init_process_group makes take CPU tensors directly and stage
/// other devices' through host memory (Note [Tensors on other devices than
/// the engine's]); a C10dProcessGroup takes what its backend accepts.
class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  virtual ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  /// This process's rank in the group, in [0, size()).
  int rank() const { return rank_; }
  /// Number of ranks in the group.
  int size() const { return size_; }
  /// Limit for every collective; a peer that does not answer within it is an error.
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// Backend name for messages ("gloo", "c10d:gloo", "local", ...).
  virtual std::string backend_name() const = 0;

  /// Gathers every rank's `shard` into `flat` (numel size() * shard.numel()),
  /// writing straight into `flat` with no full-size temporary. `shard` may be
  /// the view of `flat` at this rank's offset (in-place all-gather).
  virtual Work all_gather_into_tensor(const at::Tensor& flat, const at::Tensor& shard) = 0;

  /// Reduces `flat` across ranks and leaves this rank's shard of the result
  /// in `shard` (numel flat.numel() / size()). A real reduce-scatter: each rank
  /// sends and receives (size()-1)/size() of the buffer. `flat` is not modified.
  virtual Work reduce_scatter_tensor(const at::Tensor& shard, const at::Tensor& flat,
                                     ReduceOp op = ReduceOp::kSum) = 0;

  /// Reduces `tensor` in place across all ranks.
  virtual Work all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum) = 0;

  /// Copies `tensor` from rank `root` to all ranks, in place.
  virtual Work broadcast(const at::Tensor& tensor, int root = 0) = 0;

  /// Completes once every rank has issued it.
  virtual Work barrier() = 0;

  /// Debug mode: every collective issued from now on first exchanges a
  /// fingerprint (sequence number, operation, dtype, element count) with the
  /// other ranks, so that ranks issuing different collectives all fail at
  /// once with an error naming the ranks and their fingerprints, instead of
  /// hanging or mixing tensors. Every rank must switch it at the same point of
  /// its sequence of collectives. Initially on with
  /// ProcessGroupOptions::debug_collectives or FSDP_DEBUG=detail; sub-groups
  /// inherit it. Costs one small all-gather per collective.
  virtual void set_debug_collectives(bool on);
  /// True while debug mode is on (see set_debug_collectives()).
  virtual bool debug_collectives() const { return false; }

  /// Makes a group of the given ranks of this group (sorted, unique). Every
  /// rank of this group must call it with the same list, in the same order as
  /// its other new_subgroup calls. Returns nullptr on ranks not in the list.
  virtual std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks) = 0;

 protected:
  /// Sets the constant identity of the group.
  ProcessGroup(int rank, int size, std::chrono::milliseconds timeout);

  /// Checks the arguments of each collective; throws a c10::Error naming the
  /// collective, the expected and the actual sizes, and the fix.
  void check_all_gather(const at::Tensor& flat, const at::Tensor& shard) const;
  /// See check_all_gather().
  void check_reduce_scatter(const at::Tensor& shard, const at::Tensor& flat, ReduceOp op) const;
  /// See check_all_gather().
  void check_single(const char* op_name, const at::Tensor& tensor) const;
  /// See check_all_gather(); also checks that root is a rank of the group.
  void check_root(int root) const;
  /// See check_all_gather(); validates the rank list of new_subgroup.
  void check_subgroup_ranks(const std::vector<int>& ranks) const;

 private:
  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
};

/// Makes the groups of ranks that share a node, assuming ranks are numbered
/// node by node in blocks of `local_world_size` (as fsdprun and torchrun do),
/// and returns the calling rank's node group. Every rank of `group` must call it.
std::shared_ptr<ProcessGroup> new_node_subgroup(ProcessGroup& group, int local_world_size);

/// The groups of a HYBRID_SHARD unit (PyTorch's names): parameters are
/// sharded within `shard` (a node) and replicated across `replicate` (the
/// ranks that hold the same shard on the other nodes); `world` holds every
/// rank. Every rank is in exactly one shard group and one replicate group,
/// so shard->size() * replicate->size() == world->size().
struct HybridGroups {
  std::shared_ptr<ProcessGroup> world;      ///< every rank of the job
  std::shared_ptr<ProcessGroup> shard;      ///< this rank's node (shards within)
  std::shared_ptr<ProcessGroup> replicate;  ///< this rank's peers on other nodes
};

/// Splits `world` into shard groups of `shard_size` consecutive ranks (a
/// node, as fsdprun, torchrun, mpirun and srun number ranks) and replicate
/// groups of the ranks at the same position in each, and returns the calling
/// rank's. Every rank of `world` must call it, in the same order as its other
/// new_subgroup calls.
HybridGroups new_hybrid_groups(const std::shared_ptr<ProcessGroup>& world, int shard_size);

}  // namespace fsdp
