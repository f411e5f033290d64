#include "runtime/norm_reduce.h"

#include <ATen/ATen.h>

#include <algorithm>
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

int replicas_of(const ProcessGroup* job, const ProcessGroup& shard_group) {
  return job != nullptr ? std::max(1, job->size() / shard_group.size()) : 1;
}

NormTerms::NormTerms(double p) : p_(p), inf_(std::isinf(p)) {}

void NormTerms::add(const at::Tensor& g, double weight) {
  at::Tensor t = at::linalg_vector_norm(g, p_, c10::nullopt, /*keepdim=*/false, at::kDouble);
  if (!inf_ && p_ != 0) t = t.pow(p_);
  if (weight != 1.0) t = t * weight;
  by_device_[t.device()].push_back(std::move(t));
}

double NormTerms::value() const {
  double out = 0;
  for (const auto& [device, terms] : by_device_) {
    const at::Tensor all = at::stack(terms);
    const double v = (inf_ ? all.max() : all.sum()).item<double>();
    out = inf_ ? norm_max(out, v) : out + v;
  }
  return out;
}

double NormTerms::root(double total) const {
  return inf_ || p_ == 0 ? total : std::pow(total, 1.0 / p_);
}

}  // namespace fsdp::detail
