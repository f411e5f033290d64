#include "runtime/norm_reduce.h"

#include <ATen/ATen.h>

#include <cmath>

namespace fsdp::detail {

double norm_max(double a, double b) { return std::isnan(a) || a > b ? a : b; }

double all_norm_sum(ProcessGroup& group, double value) {
  at::Tensor t = at::full({1}, value, at::kDouble);
  group.all_reduce(t, ReduceOp::kSum).wait();
  return t.item<double>();
}

double all_norm_max(ProcessGroup& group, double value) {
  const bool nan = std::isnan(value);
  at::Tensor t = at::tensor({nan ? 0.0 : value, nan ? 1.0 : 0.0}, at::kDouble);
  group.all_reduce(t, ReduceOp::kMax).wait();
  return t[1].item<double>() > 0 ? std::nan("") : t[0].item<double>();
}

}  // namespace fsdp::detail
