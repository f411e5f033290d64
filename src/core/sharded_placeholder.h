#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include <functional>
#include <string>

namespace fsdp::detail {

/// What a placeholder stands in for; decides the error message.
enum class PlaceholderKind {
  kParameter,  ///< an original parameter while its unit is sharded
  kGradient,   ///< an original parameter's gradient, moved into the flat shard
};

/// Hears of the operators that reach the parameters of a unit made by
/// fsdp::fully_shard (see Note [Units driven by dispatch] in
/// src/runtime/unit_dispatch.cpp): its placeholders and its tracked
/// storage (track_storage) report to it instead of failing. Every unit's
/// gradient placeholders report a detach or zero_ to it (Note [Gradients
/// the user clears]); only those of fully_shard's units the rest.
class ParamUseListener {
 public:
  /// First of all for an operator on the unit's parameters: until its
  /// after_param_use the unit keeps them gathered, even where another unit
  /// the same operator reads ends the unit's forward (a torch::cat of two
  /// units' parameters).
  virtual void hold_for_operator() = 0;
  /// Before an operator runs on one of the unit's parameters; `sharded` when
  /// that parameter is a placeholder. May gather the unit, after which the
  /// parameters point at their (tracked) views.
  virtual void before_param_use(bool sharded) = 0;
  /// After before_param_use, before the operator runs, with its arguments
  /// (the unit's parameters among them).
  virtual void param_use_arguments(c10::ArrayRef<c10::IValue> args) = 0;
  /// After the operator ran, with its outputs; `wrote` when it wrote to one
  /// of the unit's parameters in place (an initialiser, a clamp_). Also,
  /// with no outputs, when it failed.
  virtual void after_param_use(c10::ArrayRef<c10::IValue> outputs, bool wrote) = 0;
  /// An out-of-place detach of `grad`, one of the unit's moved gradients
  /// (Module::zero_grad detaches each .grad before it drops or zeroes it).
  /// See Note [Gradients the user clears].
  virtual void moved_grad_detached(const at::Tensor& grad) = 0;
  /// zero_ on `grad`, one of the unit's moved gradients or a detached copy
  /// of one: the unit zeroes that parameter's gradient.
  virtual void moved_grad_zeroed(const at::Tensor& grad) = 0;
  /// The norm of order `p` of the whole gradient `grad` stands for, every
  /// rank's part (collective: every rank asks, for the same parameters in
  /// the same order), as a 0-d tensor of `grad`'s dtype and device. See Note
  /// [LibTorch's clipping of a unit made in place].
  virtual at::Tensor moved_grad_norm(const at::Tensor& grad, double p) = 0;
  /// Runs `write`, an in-place elementwise operator with scalar arguments,
  /// on this rank's part of the gradient `grad` stands for (1-D, in what the
  /// optimizer steps; possibly empty).
  virtual void write_moved_grad(const at::Tensor& grad,
                                const std::function<void(const at::Tensor& part)>& write) = 0;
  /// torch::load's set_ of `param` to `value`, a full parameter read from a
  /// file: where `param` is one of the unit's parameters (not an alias of
  /// one) the unit keeps this rank's part (and, where it stays gathered, the
  /// whole) and returns true. See Note [torch::load into a unit made in place].
  virtual bool load_param(const at::Tensor& param, const at::Tensor& value) = 0;
  /// The dtype the operator's floating-point tensor inputs (not the unit's
  /// parameters) are cast to, as a wrapper casts its forward's inputs (mixed
  /// precision); nullopt: none. Asked after before_param_use.
  virtual c10::optional<at::ScalarType> compute_dtype() const = 0;
  /// Whether `t` is one of the buffers of the unit's module tree: state an
  /// operator may update in place (BatchNorm's running statistics), which a
  /// cast copy would leave stale, so it is never cast.
  virtual bool holds_buffer(const at::Tensor& t) const = 0;

 protected:
  ~ParamUseListener() = default;
};

/// Note [Sharded placeholders]
/// While a unit is sharded its original parameters have no data, and after
/// backward their gradients live in the flat shard. Left as plain tensors,
/// a direct call of the wrapped module would read freed memory and an
/// optimizer built on the unwrapped parameters would silently skip every
/// step. Instead each original parameter (and its .grad) is pointed, with
/// set_data, at a placeholder: a CPU tensor of the same shape and dtype with
/// an empty storage and one extra dispatch key (DeferredInit, unused by
/// LibTorch itself and ordered before autograd). A boxed fallback on that key
/// turns any operator that reaches a placeholder into an error naming the
/// parameter, its unit and the fix; metadata-only operators (set_data's
/// compatibility check, detach, alias) pass through, and zero_ on a
/// gradient placeholder zeroes the gradient it stands for.
/// A Tensor::to that changes nothing returns the parameter itself, and
/// set_data that would give a unit's parameter other data is an error (Note
/// [Module::to on a sharded model] in src/runtime/unit_conversion.cpp).
/// Device and dtype are unchanged, so set_data keeps the parameter's
/// AccumulateGrad node (and libfsdp's hooks on it).
/// While alive, operators on this thread reach the parameters of fully_shard
/// units unreported: for libfsdp's own reads and writes outside forward
/// (SummonFullParams, state dicts), and the operators the fallback runs.
class UnreportedUses {
 public:
  UnreportedUses();
  ~UnreportedUses();
  UnreportedUses(const UnreportedUses&) = delete;
  UnreportedUses& operator=(const UnreportedUses&) = delete;
};
/// While alive, set_data on this thread may give a unit's parameter other
/// data, unreported (an UnreportedUses scope too): libfsdp's own pointing of
/// its parameters at placeholders, views and summoned buffers. Any other
/// (Module::to, torch::load of a file on another device, a user's) is
/// refused, inside SummonFullParams too.
class OwnSetData {
 public:
  OwnSetData();
  ~OwnSetData();
  OwnSetData(const OwnSetData&) = delete;
  OwnSetData& operator=(const OwnSetData&) = delete;

 private:
  UnreportedUses unreported_;
};
/// UnreportedUses for an object's lifetime (SummonFullParams): begin in its
/// constructor, end in its destructor, on the same thread.
void begin_unreported_uses();
void end_unreported_uses();
/// True while an UnreportedUses scope is open on this thread: inside
/// SummonFullParams (the only one user code runs in), libfsdp's state-dict
/// walks, and the operators the fallback runs.
bool unreported_uses_active();

/// With a `listener`, an operator that reaches the placeholder is reported
/// to it (which gathers the unit) instead of failing.
at::Tensor make_placeholder(const at::Tensor& like, PlaceholderKind kind, std::string what,
                            ParamUseListener* listener = nullptr);

/// Operators on a tensor that carries the placeholders' dispatch key and
/// lives in `base`'s storage (a view made by tracked_alias) are reported to
/// `listener` (with `report`; else only torch::load's set_ reaches it),
/// until untrack_storage.
void track_storage(const at::Tensor& base, ParamUseListener* listener, bool report = true);
void untrack_storage(const at::Tensor& base);
/// An alias of `view` (same storage, sizes, strides and offset) that carries
/// the placeholders' dispatch key, so operators on it reach the listener of
/// its storage (see track_storage).
at::Tensor tracked_alias(const at::Tensor& view);

/// Renames a placeholder made by make_placeholder (e.g. once the unit's path
/// from the root is known).
void rename_placeholder(const at::Tensor& placeholder, std::string what);

/// Forgets a placeholder (called before it is destroyed).
void release_placeholder(const at::Tensor& placeholder);

/// Calls f(tensor) for each tensor among `values`, those of tensor lists too.
template <typename F>
void for_each_tensor(c10::ArrayRef<c10::IValue> values, const F& f) {
  for (const c10::IValue& v : values) {
    if (v.isTensor()) {
      f(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) f(t);
    }
  }
}

/// True for a tensor that carries the placeholders' dispatch key: one made
/// by make_placeholder (or a detached alias of one), and while its unit is
/// gathered a view of its parameters (tracked_alias).
bool is_placeholder(const at::Tensor& t);

/// Runs `action` once the operator being reported on this thread has ended
/// (its units released), or at once outside one: for what must not happen
/// while its listeners are in use (freeing units).
void after_this_operator(std::function<void()> action);

/// Throws what an operator `user` on placeholder `t` would get (the
/// parameter or gradient named, and the fix), for code that reads tensors
/// without the dispatcher (fsdp::optim's fused kernels).
[[noreturn]] void refuse_placeholder_use(const at::Tensor& t, const std::string& user);

}  // namespace fsdp::detail
