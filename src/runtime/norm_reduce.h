#pragma once

// Gradient norms over the ranks: Unit::clip_grad_norm_, and the norm of a
// moved gradient that LibTorch's own clip_grad_norm_ asks a unit made in
// place for (Note [LibTorch's clipping of a unit made in place]).

#include <fsdp/comm/process_group.h>

namespace fsdp::detail {

/// The larger of a and b, NaN where either is (std::max keeps its first
/// argument against a NaN: an infinity norm over a NaN gradient was finite).
double norm_max(double a, double b);

/// `value` summed over `group` (collective).
double all_norm_sum(ProcessGroup& group, double value);

/// norm_max of `value` over `group` (collective): whether a NaN survives a
/// transport's max is not promised, so it travels as a flag of its own.
double all_norm_max(ProcessGroup& group, double value);

}  // namespace fsdp::detail
