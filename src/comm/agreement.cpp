#include "comm/agreement.h"

#include <ATen/ATen.h>

// Note [Cross-rank agreement]
// Many decisions must be taken the same way on every rank (Rules every layer
// keeps: a check that can fail on one rank only is agreed collectively): which
// ranks failed a checkpoint phase, which units reduced gradients, which
// parameters have optimizer state, what the forward order was, which
// collective comes next (debug fingerprints). Each is a few integers that
// every rank contributes, one small collective, and a read-back on the host.
// They are built here only: the tensor lives on the group's device (CPU for
// libfsdp's own groups, the GPU for an NCCL one), and the values travel as
// float64 because the collectives take floating point only; integers are
// exact up to 2^53.

namespace fsdp::detail {

at::Device group_device(const ProcessGroup& group) { return at::kCPU; }

at::Tensor small_tensor(const std::vector<int64_t>& values, at::ScalarType dtype,
                        at::Device device) {
  at::Tensor host = at::empty({static_cast<int64_t>(values.size())}, at::kLong);
  std::copy(values.begin(), values.end(), host.data_ptr<int64_t>());
  return host.to(device, dtype);
}

std::vector<int64_t> small_values(const at::Tensor& tensor) {
  const at::Tensor host = tensor.to(at::kCPU, at::kLong).contiguous();
  const int64_t* p = host.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + host.numel());
}

std::vector<int64_t> agree_reduce(ProcessGroup* group, std::vector<int64_t> values, ReduceOp op) {
  if (group == nullptr || group->size() == 1) return values;
  const at::Tensor t = small_tensor(values, at::kDouble, group_device(*group));
  group->all_reduce(t, op).wait();
  return small_values(t);
}

std::vector<int64_t> agree_gather(ProcessGroup* group, const std::vector<int64_t>& mine) {
  if (group == nullptr || group->size() == 1) return mine;
  const at::Tensor t = small_tensor(mine, at::kDouble, group_device(*group));
  const at::Tensor all = at::empty({t.numel() * group->size()}, t.options());
  group->all_gather_into_tensor(all, t).wait();
  return small_values(all);
}

}  // namespace fsdp::detail
