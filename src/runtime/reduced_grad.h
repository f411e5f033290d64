#pragma once

// Handing a reduced gradient to what the optimizer steps. See Note [Handing
// over the reduced gradient] in reduced_grad.cpp.

#include <ATen/core/Tensor.h>

#include <fsdp/runtime/reduced_grad_hooks.h>

#include <cstdint>
#include <vector>

namespace fsdp::detail {

/// Whether every byte of a contiguous tensor is zero (+0.0 in every element
/// of a floating-point tensor). Stops at the first non-zero byte; false for a
/// non-contiguous tensor, which it does not read.
bool all_zero_bits(const at::Tensor& t);

/// Adds `grad` to `param`'s gradient as autograd would, without the add where
/// it can: an undefined gradient takes `grad` (a copy if it is a view), and a
/// gradient of all +0.0 (LibTorch 1.13's zero_grad()) gets `grad`'s storage.
void accumulate_reduced_grad(at::Tensor& param, const at::Tensor& grad);

/// Whether accumulate_reduced_grad(param, grad) would take `grad` itself
/// (not a view) without reading its values: param's .grad is undefined, or
/// all +0.0 of grad's dtype and sizes.
bool takes_reduced_grad(const at::Tensor& param, const at::Tensor& grad);

/// Makes `grad` (not a view) param's gradient, the same tensor object where
/// one is defined: what accumulate_reduced_grad does where
/// takes_reduced_grad(param, grad), without checking it again.
void take_reduced_grad(at::Tensor& param, const at::Tensor& grad);

/// Where part of a unit's reduced gradient goes: `param`'s .grad gets `numel`
/// elements of it from `offset`, or all of it when numel < 0 (a flat shard).
struct GradTarget {
  at::Tensor param;
  int64_t offset = 0;
  int64_t numel = -1;
};

/// accumulate_reduced_grad for each target, from `grad` (the shard's gradient).
void set_reduced_grads(const std::vector<GradTarget>& targets, const at::Tensor& grad);

/// Elements in each part of a gradient handed over in parts (Note [Stepping
/// a gradient as it lands]), 0 for whole: FSDP_GRAD_PART_ELEMENTS where set
/// (on the CPU too: the tests' way to cut small gradients), else 4 Mi
/// elements for a gradient that `goes_to_host` from a GPU, else 0.
int64_t grad_part_elements(bool goes_to_host);

/// Cuts gradients of `sizes` elements, in order, into parts of about
/// `part_elements` each (the last may be up to half a part longer; a
/// gradient may span parts, a part may hold several). One part (or none,
/// for nothing) where the total is under two parts.
std::vector<std::vector<ParamRange>> plan_grad_parts(const std::vector<int64_t>& sizes,
                                                     int64_t part_elements);

}  // namespace fsdp::detail
