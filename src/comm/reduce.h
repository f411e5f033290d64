#pragma once

#include <ATen/ATen.h>

#include <fsdp/comm/types.h>

namespace fsdp::detail {

// Note [One reduction]
// Every route that reduces (the rings over the direct links or Gloo's pairs,
// shared memory, c10d's backends) combines with reduce_into() and ends
// with finish_reduction(), so a ReduceOp means the same on every route: kSum
// and kAvg add in the tensor's own dtype, kMax and kMin are ATen's maximum
// and minimum (a NaN on any rank wins), and kAvg divides the sum by the group
// size once at the end (as NCCL's avg does). Both write into existing
// memory: no route allocates for its reduction.

/// out = a (op) b, elementwise; `out` may be `a` itself. kAvg adds: the caller
/// calls finish_reduction() once the sum is complete.
inline void reduce_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                        ReduceOp op) {
  at::Tensor result = out;  // the _out functions take a non-const reference
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      at::add_out(result, a, b);
      return;
    case ReduceOp::kMax:
      at::maximum_out(result, a, b);
      return;
    case ReduceOp::kMin:
      at::minimum_out(result, a, b);
      return;
  }
}

/// Completes a reduction over `size` ranks whose combining is done: kAvg
/// divides by `size`; the other ops are complete already.
inline void finish_reduction(const at::Tensor& t, ReduceOp op, int size) {
  if (op == ReduceOp::kAvg) t.div_(size);
}

}  // namespace fsdp::detail
