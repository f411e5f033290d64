#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/comm/process_group.h>

namespace fsdp {

/// One original parameter inside a FlatParameter.
struct FlatParamSlot {
  std::string name;            ///< path from the unit's module ("0.weight")
  at::Tensor param;            ///< the module's own parameter tensor object
  std::vector<int64_t> shape;  ///< its shape
  int64_t offset = 0;          ///< element offset in the unsharded flat buffer
  int64_t numel = 0;           ///< its number of elements
};

/// A unit's parameters as one flat buffer, sharded over a process group.
///
/// Note [FlatParameter vocabulary]
/// - original parameters: the module's own tensors. While unsharded they are
///   views of the *unsharded flat buffer* (set_data), so module code is never
///   changed and autograd sees ordinary leaves.
/// - unsharded flat buffer: all original parameters back to back, padded to a
///   multiple of the world size. Sharding frees its storage by resizing the
///   StorageImpl to 0 bytes; unsharding resizes it back and all-gathers into
///   it. Views autograd saved in forward share that StorageImpl, so they see
///   the refilled data (see libtorch-mechanisms.md §1).
/// - sharded parameter (`shard()`): this rank's contiguous 1/N of the padded
///   buffer, a leaf with its own storage: what the optimizer steps and where
///   the reduced gradient ends. With keep_unsharded (NO_SHARD) it is the whole
///   buffer, sharing its storage.
/// - while sharded, each original parameter points at a placeholder that
///   turns any use into an error naming it (Note [Sharded placeholders]).
class FlatParameter {
 public:
  /// kSharded: only shard() holds data. kUnsharded: the original parameters
  /// hold the full values.
  enum class State { kSharded, kUnsharded };

  /// Flattens `params` (all one dtype, on CPU) and, unless keep_unsharded,
  /// shards them and frees the unsharded buffer.
  FlatParameter(std::vector<std::pair<std::string, at::Tensor>> params,
                std::shared_ptr<ProcessGroup> group, bool keep_unsharded);
  ~FlatParameter();
  FlatParameter(const FlatParameter&) = delete;
  FlatParameter& operator=(const FlatParameter&) = delete;

  /// Names the unit in error messages about its sharded parameters (its
  /// module path from the root, "" for the root).
  void set_unit_path(const std::string& path);

  /// Current state.
  State state() const { return state_; }
  /// The tensor the optimizer steps (see Note [FlatParameter vocabulary]).
  const at::Tensor& shard() const { return shard_; }
  /// The parameters in flattening order.
  const std::vector<FlatParamSlot>& slots() const { return slots_; }
  /// Elements of all original parameters (without padding).
  int64_t numel() const { return numel_; }
  /// Element offset of shard() within the padded unsharded buffer.
  int64_t shard_offset() const { return keep_unsharded_ ? 0 : group_->rank() * shard_numel_; }
  /// Elements of the padded unsharded buffer.
  int64_t padded_numel() const { return padded_numel_; }
  /// The group that shards this buffer.
  ProcessGroup& group() const { return *group_; }
  /// True when the buffer is never sharded (NO_SHARD).
  bool keeps_unsharded() const { return keep_unsharded_; }

  /// kSharded -> kUnsharded: allocates the unsharded buffer and starts the
  /// all-gather into it (a prefetch); unshard() or reshard() waits for it.
  void unshard_async();
  /// Makes the original parameters hold the full values (waits for a pending
  /// all-gather, or gathers now).
  void unshard();
  /// kUnsharded -> kSharded: frees the unsharded buffer (no-op for NO_SHARD).
  /// A pending all-gather is waited for first: it writes into that buffer.
  void reshard();

  /// Copies this rank's part of the unsharded buffer into the shard (after
  /// the full parameters were modified in place). No-op for NO_SHARD, whose
  /// shard is the buffer.
  void copy_unsharded_into_shard();
  /// A zeroed buffer of padded_numel() for gradients, in the shard's dtype.
  at::Tensor new_flat_grad() const;
  /// The view of `flat` that belongs to slot i.
  at::Tensor slot_view(const at::Tensor& flat, size_t i) const;

 private:
  void resize_unsharded_storage(bool allocate);

  // Constant after construction.
  std::shared_ptr<ProcessGroup> group_;
  bool keep_unsharded_;
  std::vector<FlatParamSlot> slots_;
  int64_t numel_ = 0;
  int64_t padded_numel_ = 0;
  int64_t shard_numel_ = 0;
  at::Tensor unsharded_;                  // its StorageImpl is resized, never replaced
  std::vector<at::Tensor> views_;         // per slot: its view of unsharded_
  std::vector<at::Tensor> placeholders_;  // per slot, while sharded
  at::Tensor shard_;

  State state_ = State::kUnsharded;
  Work pending_unshard_;  // the all-gather started by unshard_async()
};

/// The name of a FlatParameter state, for messages.
const char* to_string(FlatParameter::State state);

}  // namespace fsdp
