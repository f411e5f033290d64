#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/comm/process_group.h>

#include "core/copy_in_ahead.h"
#include "core/device_streams.h"

namespace fsdp::detail {
class ParamUseListener;                         // core/sharded_placeholder.h
using ParamUseListenerPtr = ParamUseListener*;  // a TORCH_ARG type (no bare `T*` there)
}  // namespace fsdp::detail

namespace fsdp {

/// One original parameter inside a FlatParameter.
struct FlatParamSlot {
  std::string name;            ///< path from the unit's module ("0.weight")
  at::Tensor param;            ///< the module's own parameter tensor object
  std::vector<int64_t> shape;  ///< its shape
  int64_t offset = 0;          ///< element offset in the unsharded flat buffer
  int64_t numel = 0;           ///< its number of elements
};

/// How a FlatParameter is built, beyond its parameters and group.
struct FlatParamConfig {
  /// Never shard (NO_SHARD): the shard is the whole buffer.
  TORCH_ARG(bool, keep_unsharded) = false;
  /// Where the flat buffers live (the unit's device, Note [One seam for
  /// devices] in core/device_storage.h); every parameter is on it or on the
  /// meta device.
  TORCH_ARG(c10::Device, device) = c10::Device(c10::kCPU);
  /// The shard (what the optimizer steps) lives in host memory instead of
  /// on `device`: unsharding copies it to the device, see Note [Shards in
  /// host memory].
  TORCH_ARG(bool, offload_shard) = false;
  /// With offload_shard on a GPU: page-locked host memory.
  TORCH_ARG(bool, pin_shard) = false;
  /// Dtype of the unsharded flat buffer (see Note [Mixed precision] in
  /// fsdp/core/mixed_precision.h); nullopt: the parameters' dtype.
  TORCH_ARG(c10::optional<at::ScalarType>, param_dtype) = c10::nullopt;
  /// Dtype of the flat gradient buffer; nullopt: param_dtype.
  TORCH_ARG(c10::optional<at::ScalarType>, reduce_dtype) = c10::nullopt;
  /// Called once, after the original parameters became views of the
  /// (allocated, full-precision) unsharded flat buffer and before it is
  /// sharded, with that buffer: deferred initialisation fills meta
  /// parameters here and sync_module_states broadcasts it. Required when a
  /// parameter is on the meta device (it has no values to copy).
  TORCH_ARG(std::function<void(const at::Tensor& unsharded)>, fill) = nullptr;
  /// A unit made by fsdp::fully_shard: every operator on the original
  /// parameters, sharded or not, is reported to this listener (see Note [Units
  /// driven by dispatch]); nullptr: only misuse of a sharded one is caught.
  TORCH_ARG(detail::ParamUseListenerPtr, use_listener) = nullptr;
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
  /// kSharded: only shard() holds data. kUnsharding: the unsharded buffer is
  /// allocated and an all-gather into it is in flight (begin_unshard).
  /// kUnsharded: the original parameters hold the full values. A
  /// FlatParameter that never frees its buffer (NO_SHARD in full precision)
  /// is always kUnsharded. Transitions assert the state they start from: the
  /// unit decides when to call them, and its collectives (unit_collectives.h)
  /// fill the buffer. kSummoned: the original parameters hold the
  /// full-precision values in a buffer of their own (under mixed precision,
  /// or in host memory: Note [Summoning in full precision]); only
  /// SummonFullParams and the state dicts put it there, from kSharded, and
  /// nothing may gather it until it returns.
  enum class State { kSharded, kUnsharding, kUnsharded, kSummoned };

  /// Flattens `params` (all one dtype, on CPU) and, unless keep_unsharded,
  /// shards them and frees the unsharded buffer.
  FlatParameter(std::vector<std::pair<std::string, at::Tensor>> params,
                std::shared_ptr<ProcessGroup> group, bool keep_unsharded);
  /// Flattens `params` (all one dtype, on CPU or on the meta device) as
  /// `config` says. Without a fill, the shard is copied straight from the
  /// parameters and the unsharded buffer is never allocated, so building
  /// needs the parameters' bytes plus one shard.
  FlatParameter(std::vector<std::pair<std::string, at::Tensor>> params,
                std::shared_ptr<ProcessGroup> group, FlatParamConfig config);
  ~FlatParameter();
  FlatParameter(const FlatParameter&) = delete;
  FlatParameter& operator=(const FlatParameter&) = delete;

  /// Names the unit in error messages about its sharded parameters (its
  /// module path from the root, "" for the root).
  void set_unit_path(const std::string& path);
  /// "FSDP unit '<path>'" (or "the root FSDP unit"), for messages.
  const std::string& unit_label() const { return unit_label_; }
  /// The unit's module path from the root ("" for the root), once set.
  const std::string& unit_path() const { return unit_path_; }

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
  /// Where a slot meets this rank's shard: the slot's elements
  /// [in_param, in_param + numel) are the shard's [in_shard, in_shard +
  /// numel); all 0 where they do not meet.
  struct ShardPart {
    int64_t in_shard = 0;  ///< offset in shard()
    int64_t in_param = 0;  ///< offset in the flattened parameter
    int64_t numel = 0;     ///< elements in both
  };
  /// Slot `i`'s part of this rank's shard.
  ShardPart shard_part(size_t i) const;
  /// Copies this rank's part of `full`, slot `i`'s whole value (any shape
  /// with its elements), into the shard (in place, outside autograd).
  void copy_into_shard(size_t i, const at::Tensor& full);
  /// Elements of the padded unsharded buffer.
  int64_t padded_numel() const { return padded_numel_; }
  /// The group that shards this buffer.
  ProcessGroup& group() const { return *group_; }
  /// True when the buffer is never sharded (NO_SHARD).
  bool keeps_unsharded() const { return keep_unsharded_; }

  /// kSharded -> kUnsharding: allocates the unsharded buffer, points the
  /// original parameters at their views of it and returns the all-gather
  /// input (the shard, in param_dtype()) to gather into unsharded(). NO_SHARD
  /// copies it in itself and ends kUnsharded.
  at::Tensor begin_unshard();
  /// kUnsharding -> kUnsharded: the all-gather into unsharded() completed.
  void end_unshard();
  /// kUnsharded -> kSharded: frees the unsharded buffer. Only where
  /// frees_unsharded(), and never while an all-gather writes into it. On a
  /// device with streams the memory comes back held, for the caller to
  /// release (Note [Copy-in on a stream of its own]); the CPU's is freed.
  [[nodiscard]] std::optional<detail::HeldMemory> reshard();
  /// The unsharded flat buffer (the all-gather output); freed while kSharded.
  const at::Tensor& unsharded() const { return unsharded_; }
  /// False when the unsharded buffer is the shard itself (NO_SHARD in full
  /// precision, on the device): then the FlatParameter stays kUnsharded.
  bool frees_unsharded() const { return !keep_unsharded_ || low_precision_ || offloaded_; }
  /// True when shard() lives in host memory apart from the unsharded buffer's
  /// device (FlatParamConfig::offload_shard).
  bool offloaded() const { return offloaded_; }
  /// Whether the offloaded shard is page-locked (its copies need not block).
  bool shard_pinned() const { return pinned_shard_; }
  /// Offloaded and in low precision: a host copy of the shard in
  /// param_dtype() (pinned like the shard), filled from the shard now, that
  /// begin_unshard() sends to the device instead of the shard while it is
  /// current: while every write of the shard writes it too and bumps both
  /// version counters once (fsdp::optim::FusedAdamW). See Note [A host copy
  /// in the compute dtype].
  const at::Tensor& low_precision_host_copy();
  /// Whether begin_unshard() sends low_precision_host_copy() (it is as new as
  /// the shard) rather than the shard.
  bool low_precision_copy_current() const;
  /// Where the host copy is current and the buffer sharded (not NO_SHARD): a
  /// function to call with each range [begin, end) of the shard, in order,
  /// once the optimizer has written it, which sends the range's new host
  /// copy to the device for the next begin_unshard() to take instead of
  /// copying (Note [Copy-in at the step] in core/copy_in_ahead.h). Else empty.
  std::function<void(int64_t begin, int64_t end)> copy_in_ahead_sender();
  /// Where copy_in_ahead_sender() sends to (nullptr before its first call).
  const detail::CopyInAhead* copy_in_ahead() const { return ahead_.get(); }

  /// In kUnsharded, where frees_unsharded(), or in kSummoned: copies this
  /// rank's part of the full parameters into the shard (after they were
  /// modified in place).
  void copy_unsharded_into_shard();
  /// The same for elements [begin, end) of the unsharded buffer only.
  void copy_unsharded_into_shard(int64_t begin, int64_t end);
  /// kSharded -> kSummoned, for a low_precision() FlatParameter or a `full`
  /// in host memory: the original parameters become views of `full`
  /// (padded_numel() elements in the shard's dtype, every rank's shard:
  /// gather_full in runtime/unit_collectives.h), keeping their gradient
  /// accumulators.
  void begin_summon(at::Tensor full);
  /// kSummoned -> kSharded: the parameters point at their placeholders again
  /// and the full-precision buffer is dropped.
  void end_summon();
  /// Gathered or gathering into a buffer apart from the shard (a prefetch
  /// still arriving counts: it began before what comes since).
  bool gathered_apart_from_shard() const {
    return (state_ == State::kUnsharded || state_ == State::kUnsharding) && frees_unsharded();
  }
  /// gathered_apart_from_shard(), and the shard written since the gather
  /// began, through a tensor that counts versions: an optimizer step (not
  /// LibTorch's SGD, which writes through .data()), a load, an in-place
  /// write. See Note [Gathered before a step].
  bool gathered_behind_shard() const {
    return gathered_apart_from_shard() && shard_._version() != gathered_version_;
  }
  /// Whether the original parameters hold the full-precision values now
  /// (kSummoned, or kUnsharded without mixed precision).
  bool holds_full_values() const {
    return state_ == State::kSummoned || (state_ == State::kUnsharded && !low_precision_);
  }
  /// Dtype of the unsharded buffer and of the original parameters.
  at::ScalarType param_dtype() const { return unsharded_.scalar_type(); }
  /// Dtype of new_flat_grad() (the reduction's dtype).
  at::ScalarType grad_dtype() const { return grad_dtype_; }
  /// True when the unsharded buffer has another dtype than the shard.
  bool low_precision() const { return low_precision_; }

  /// An uninitialised buffer of padded_numel() for gradients, in grad_dtype():
  /// the caller fills every slot and calls zero_padding() before reducing it.
  at::Tensor new_flat_grad() const;
  /// Zeroes the elements of `flat` past the last slot (the padding).
  void zero_padding(const at::Tensor& flat) const;
  /// The view of `flat` that belongs to slot i.
  at::Tensor slot_view(const at::Tensor& flat, size_t i) const;

 private:
  void resize_unsharded_storage(bool allocate);
  void build_shard_directly();
  void build_through_unsharded(const FlatParamConfig& config);
  void bind(FlatParamSlot& slot);
  void use_low_precision(at::ScalarType dtype);
  void offload_shard(bool pinned);
  // Point the original parameters at their views of unsharded_, or at their
  // placeholders (made on first use, in unsharded_'s dtype).
  void point_at_views();
  void point_at_placeholders();

  // Constant after construction.
  std::shared_ptr<ProcessGroup> group_;
  bool keep_unsharded_;
  detail::ParamUseListener* listener_;  // see FlatParamConfig::use_listener
  std::vector<FlatParamSlot> slots_;
  int64_t numel_ = 0;
  int64_t padded_numel_ = 0;
  int64_t shard_numel_ = 0;
  at::Tensor unsharded_;                     // its StorageImpl is resized, never replaced
  std::vector<at::Tensor> views_;            // per slot: its view of unsharded_
  std::vector<at::Tensor> placeholders_;     // per slot, while sharded
  std::string unit_label_ = "an FSDP unit";  // in placeholder messages
  std::string unit_path_;
  at::Tensor shard_;
  bool low_precision_ = false;
  bool offloaded_ = false;
  bool pinned_shard_ = false;  // page-locked: its copies to the device need not block
  // See low_precision_host_copy(): the copy, and the two version counters
  // when it was last filled from the shard.
  at::Tensor low_precision_host_;
  int64_t gathered_version_ = 0;  // shard_._version() at the last gather
  int64_t shard_version_base_ = 0;
  int64_t copy_version_base_ = 0;
  // See copy_in_ahead_sender(); shared with the senders it made.
  std::shared_ptr<detail::CopyInAhead> ahead_;
  // The shard as begin_unshard() sends it to the device.
  const at::Tensor& unshard_source() const {
    return low_precision_copy_current() ? low_precision_host_ : shard_;
  }
  at::ScalarType grad_dtype_ = at::kFloat;
  // In kSummoned: the full-precision buffer, and per slot the gradient
  // accumulator that set_data to another dtype or device made autograd
  // forget (restored by end_summon).
  at::Tensor summoned_;
  std::vector<decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()))>
      summoned_accumulators_;

  State state_ = State::kUnsharded;
};

/// The name of a FlatParameter state, for messages.
const char* to_string(FlatParameter::State state);

}  // namespace fsdp
