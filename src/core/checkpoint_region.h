#pragma once

// What FSDP units ask of the activation_checkpoint() region they run in
// (Note [Activation checkpointing] in activation_checkpoint.cpp).

#include <ATen/core/Tensor.h>

namespace fsdp::detail {

/// Whether the innermost activation_checkpoint() region whose forward runs
/// on this thread lists `t` among its params (false outside one, and in a
/// recomputation).
bool checkpoint_region_takes(const at::Tensor& t);

}  // namespace fsdp::detail
