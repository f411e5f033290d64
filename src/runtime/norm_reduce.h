#pragma once

// Gradient norms over the ranks: Unit::clip_grad_norm_, and the norm of a
// moved gradient that LibTorch's own clip_grad_norm_ asks a unit made in
// place for (Note [LibTorch's clipping of a unit made in place]).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <unordered_map>
#include <vector>

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

/// How many copies of a shard of `shard_group` the job holds: HYBRID_SHARD's
/// replicas (1 without a job group, or where the shard group is the job).
int replicas_of(const ProcessGroup* job, const ProcessGroup& shard_group);

/// A norm's terms as float64 scalars on their gradients' devices, read on
/// the host once per device: one synchronisation per clip, not one per
/// gradient (use_orig_params has one per parameter), and no float64 copy of
/// a gradient (torch's clip_grad_norm_ stacks per-gradient norms too).
class NormTerms {
 public:
  /// For the norm of order `p` (>= 0).
  explicit NormTerms(double p);
  /// Adds ||g||_p^p (||g||_inf for the infinity norm, the count of nonzero
  /// elements for order 0), times `weight`.
  void add(const at::Tensor& g, double weight = 1.0);
  /// Their sum (their maximum, NaN if any is, for the infinity norm).
  double value() const;
  /// The norm of terms that add up to `total` (a sum over the ranks).
  double root(double total) const;

 private:
  double p_;
  bool inf_;
  std::unordered_map<c10::Device, std::vector<at::Tensor>> by_device_;
};

}  // namespace fsdp::detail
