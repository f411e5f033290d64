#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <typeinfo>
#include <vector>

#include <c10/util/Type.h>

namespace fsdp {

/// A class of modules, tested with dynamic_cast (isinstance semantics): what
/// MixedPrecision::module_classes_to_ignore lists. Made with module_class<Impl>().
struct ModuleClass {
  /// The class name, for messages ("torch::nn::BatchNorm1dImpl").
  std::string name;
  /// True when a module is of the class or derives from it.
  std::function<bool(const torch::nn::Module&)> matches;
};

/// The ModuleClass of Impl (an Impl class such as torch::nn::BatchNorm2dImpl).
template <typename Impl>
ModuleClass module_class() {
  return ModuleClass{c10::demangle(typeid(Impl).name()), [](const torch::nn::Module& m) {
                       return dynamic_cast<const Impl*>(&m) != nullptr;
                     }};
}

/// The BatchNorm family (1d, 2d, 3d): the default of module_classes_to_ignore.
std::vector<ModuleClass> default_module_classes_to_ignore();

/// Mixed-precision training of a unit (PyTorch's MixedPrecision):
/// `fsdp::FSDPOptions().mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16))`.
///
/// Note [Mixed precision]
/// The sharded parameter (the flat shard the optimizer steps) keeps the
/// dtype the model was built in. To unshard, the shard is cast to
/// param_dtype (the low-precision shard) and that is all-gathered into an
/// unsharded flat buffer of param_dtype, so the all-gather moves
/// sizeof(param_dtype) bytes per element; the original parameters are views
/// of that buffer, so forward and backward compute in param_dtype. Gradients
/// are flattened into a buffer of reduce_dtype, reduce-scattered in it, and
/// cast back to the shard's dtype (unless keep_low_precision_grads) before
/// they become the shard's .grad. SummonFullParams shows the full-precision
/// values (the shards gathered as they are), as PyTorch's FSDP1 does (Note
/// [Summoning in full precision] in src/core/flat_parameter.cpp).
struct MixedPrecision {
  /// Dtype of the unsharded parameters: forward and backward compute and the
  /// all-gather. nullopt: the model's dtype.
  TORCH_ARG(c10::optional<at::ScalarType>, param_dtype) = c10::nullopt;
  /// Dtype of the gradient reduction. nullopt: param_dtype (or the model's dtype).
  TORCH_ARG(c10::optional<at::ScalarType>, reduce_dtype) = c10::nullopt;
  /// Dtype floating-point buffers are cast to when the unit is made.
  /// nullopt: unchanged.
  TORCH_ARG(c10::optional<at::ScalarType>, buffer_dtype) = c10::nullopt;
  /// Keep the shard's gradient in param_dtype (the dtype forward and backward
  /// compute in), whatever reduce_dtype, instead of the shard's dtype: as
  /// PyTorch's FSDP1 does.
  TORCH_ARG(bool, keep_low_precision_grads) = false;
  /// Cast the floating-point tensor arguments of every unit's forward (the
  /// root's too, as PyTorch's FSDP does) to param_dtype.
  TORCH_ARG(bool, cast_forward_inputs) = false;
  /// Cast the floating-point tensor arguments of the root unit's forward to
  /// param_dtype.
  TORCH_ARG(bool, cast_root_forward_inputs) = true;
  /// Dtype the floating-point tensors of a unit's forward output are cast to
  /// (FSDP2's MixedPrecisionPolicy output_dtype: float32 logits from a bf16
  /// model); nullopt: left in the compute dtype. Every unit given it casts,
  /// so give it to the root's options alone, or with cast_forward_inputs.
  /// Wrappers only: fully_shard refuses it (a unit made in place sees no
  /// forward output).
  TORCH_ARG(c10::optional<at::ScalarType>, output_dtype) = c10::nullopt;
  /// Modules of these classes must compute in full precision: auto_wrap makes
  /// each its own unit with mixed precision off (inputs cast to the module's
  /// dtype, outputs back to the inputs' dtype), with a warning.
  TORCH_ARG(std::vector<ModuleClass>,
            module_classes_to_ignore) = default_module_classes_to_ignore();
};

/// "MixedPrecision(param_dtype=BFloat16, reduce_dtype=-, ...)", for messages.
std::string to_string(const MixedPrecision& mp);

}  // namespace fsdp
