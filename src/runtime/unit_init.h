#pragma once

// Making a unit beyond flattening: deferred (meta-device) initialisation,
// sync_module_states and mixed-precision buffers. See Note [Deferred
// initialisation] in fsdp/core/reset_parameters.h.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fsdp/runtime/options.h>

namespace fsdp::detail {

/// The modules of options.ignored_modules(), for lookups.
using ModuleSet = std::unordered_set<const torch::nn::Module*>;
ModuleSet ignored_module_set(const FSDPOptions& options);
/// The parameters of options.ignored_modules() and options.ignored_params(),
/// by TensorImpl: no unit manages them, wherever else they are registered
/// (PyTorch's _get_ignored_params), and no policy counts them.
std::unordered_set<const void*> ignored_params(const FSDPOptions& options);

/// Rejects an empty param_init_fn ("expected param_init_fn to be callable").
void check_param_init_fn(const FSDPOptions& options, const std::string& where);

/// PyTorch's _validate_frozen_params for one unit, however it is made (typed
/// wrapper, wrap(), Sequential entry, auto_wrap): the parameters it manages,
/// `params` (named as the user knows them), must be all trainable or all
/// frozen. Without use_orig_params a mix is an error (a flat parameter has
/// one requires_grad); with it a warning (gradient memory as if all
/// trained), given only when `warn`. Both list the parameters on each side.
/// `where` names the unit ("" for the root).
void check_uniform_requires_grad(const std::vector<std::pair<std::string, at::Tensor>>& params,
                                 const std::string& where, bool use_orig_params, int rank,
                                 bool warn);

/// The device a unit lives on (Note [One seam for devices] in
/// core/device_storage.h): options.device_id(), else the device of its first
/// parameter not on the meta device, else the CPU. A device units cannot live
/// on yet is an error naming where it came from; a parameter on another
/// device is FlatParameter's error, naming it. `where` names the unit.
c10::Device resolve_unit_device(const FSDPOptions& options,
                                const std::vector<std::pair<std::string, at::Tensor>>& params,
                                int rank, const std::string& where);

/// While alive, a unit made on this thread is named `path` (its place from
/// the root) in messages: auto_wrap knows it; a unit made by hand is named by
/// its module's type.
class UnitPathScope {
 public:
  explicit UnitPathScope(std::string path);
  ~UnitPathScope();
  UnitPathScope(const UnitPathScope&) = delete;
  UnitPathScope& operator=(const UnitPathScope&) = delete;
  /// The innermost live scope's path, or nullptr.
  static const std::string* current();

 private:
  std::string path_;
  const std::string* previous_;
};

/// A buffer MixedPrecision::buffer_dtype cast when the unit was made, and its
/// dtype before: the one state dicts, checkpoints and torch::save hold it in
/// (PyTorch's FSDP saves buffers in their original dtypes too), so that they
/// load into the unwrapped model unchanged.
struct CastBuffer {
  at::Tensor buffer;  ///< the module's own buffer object
  at::ScalarType saved_dtype;
};

/// What a unit does to its modules' state when it is made, in three steps:
/// the constructor finds the modules the unit manages and gives their meta
/// buffers storage; fill() (inside the FlatParameter's construction, with the
/// unsharded buffer, or alone when the unit has no parameters) initialises
/// the modules that had meta state and broadcasts rank 0's values;
/// cast_buffers() applies MixedPrecision::buffer_dtype.
class UnitInit {
 public:
  /// `root` is the unit's wrapped module (its own parameters are the unit's);
  /// meta buffers get storage on `device`, the unit's.
  UnitInit(torch::nn::Module& root, const FSDPOptions& options, c10::Device device);

  /// True when fill() has work: deferred modules, or sync_module_states.
  bool needs_fill() const { return !deferred_.empty() || options_.sync_module_states(); }
  /// See the class comment; `unsharded` may be undefined (no parameters).
  void fill(const at::Tensor& unsharded);
  /// Casts the managed floating-point buffers to buffer_dtype, if set;
  /// returns those it cast.
  std::vector<CastBuffer> cast_buffers();

 private:
  const FSDPOptions& options_;
  c10::Device device_;
  std::vector<torch::nn::Module*> managed_;   // breadth first from the root
  std::vector<torch::nn::Module*> deferred_;  // those with meta state of their own
  std::vector<at::Tensor> buffers_;           // managed buffers, in managed_ order
};

}  // namespace fsdp::detail
