#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace fsdp::detail {

/// What a placeholder stands in for; decides the error message.
enum class PlaceholderKind {
  kParameter,  ///< an original parameter while its unit is sharded
  kGradient,   ///< an original parameter's gradient, moved into the flat shard
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
/// gradient placeholder is a no-op so Module::zero_grad() keeps working.
/// Device and dtype are unchanged, so set_data keeps the parameter's
/// AccumulateGrad node (and libfsdp's hooks on it).
at::Tensor make_placeholder(const at::Tensor& like, PlaceholderKind kind, std::string what);

/// Renames a placeholder made by make_placeholder (e.g. once the unit's path
/// from the root is known).
void rename_placeholder(const at::Tensor& placeholder, std::string what);

/// Forgets a placeholder (called before it is destroyed).
void release_placeholder(const at::Tensor& placeholder);

/// True for a tensor made by make_placeholder (or a detached alias of one).
bool is_placeholder(const at::Tensor& t);

}  // namespace fsdp::detail
