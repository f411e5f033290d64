#pragma once

// One home for the small cross-rank agreements: see Note [Cross-rank
// agreement] in agreement.cpp.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include <fsdp/comm/process_group.h>

namespace fsdp::detail {

/// How many process groups of more than one rank this process holds now
/// (each one counted from its construction to its destruction).
int64_t multi_rank_groups_alive();

/// `group`'s rank for an error message; -1 without a group, which the message
/// then takes from the launcher (see Note [Error messages]).
inline int64_t rank_or_none(const ProcessGroup* group) {
  return group != nullptr ? group->rank() : -1;
}

/// Whether ProcessGroup's collectives carry tensors of `dtype`: float32,
/// float64, bfloat16 and float16 (other dtypes travel as bytes in one).
inline bool collective_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 ||
         dtype == at::kHalf;
}

/// The device of the tensors `group`'s collectives take, where a unit's
/// buffers and the group's agreements live: the CPU for every group today
/// (the device seam of the GPU work starts here).
at::Device group_device(const ProcessGroup& group);

/// `values` as a 1-D tensor of `dtype` on `device` (exact for integers up to
/// 2^53 in float64).
at::Tensor small_tensor(const std::vector<int64_t>& values, at::ScalarType dtype,
                        at::Device device);

/// The elements of a small tensor written by small_tensor() (or gathered from
/// several), read back on the host as int64.
std::vector<int64_t> small_values(const at::Tensor& tensor);

/// Every rank's `values` (the same length on every rank) reduced element-wise
/// by `op` over `group`; `values` as they are when `group` is null or of size 1.
std::vector<int64_t> agree_reduce(ProcessGroup* group, std::vector<int64_t> values, ReduceOp op);

/// Every rank's `mine` (the same length n on every rank), rank after rank:
/// size() * n values; `mine` when `group` is null or of size 1.
std::vector<int64_t> agree_gather(ProcessGroup* group, const std::vector<int64_t>& mine);

}  // namespace fsdp::detail
