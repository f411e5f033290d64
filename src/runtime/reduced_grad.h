#pragma once

// Handing a reduced gradient to what the optimizer steps. See Note [Handing
// over the reduced gradient] in reduced_grad.cpp.

#include <ATen/core/Tensor.h>

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

/// Where part of a unit's reduced gradient goes: `param`'s .grad gets `numel`
/// elements of it from `offset`, or all of it when numel < 0 (a flat shard).
struct GradTarget {
  at::Tensor param;
  int64_t offset = 0;
  int64_t numel = -1;
};

/// accumulate_reduced_grad for each target, from `grad` (the shard's gradient).
void set_reduced_grads(const std::vector<GradTarget>& targets, const at::Tensor& grad);

}  // namespace fsdp::detail
