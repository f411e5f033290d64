#pragma once

// Rank 0's state dict sent to every rank: StateDictOptions::broadcast_from_rank0.

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include <string>

#include <fsdp/comm/process_group.h>

namespace fsdp::detail {

/// Collective over `group`: rank 0's `dict` on every rank (names, shapes,
/// dtypes and values; in host memory on the others). The other ranks'
/// `dict` is not read. `dict` itself when `group` is null or of size 1.
torch::OrderedDict<std::string, at::Tensor> broadcast_dict(
    ProcessGroup* group, const torch::OrderedDict<std::string, at::Tensor>& dict);

}  // namespace fsdp::detail
