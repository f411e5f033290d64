#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <utility>
#include <vector>

namespace fsdp {

/// For each FSDP unit of `model` whose shard is offloaded to host memory and
/// computes in a lower precision (CPUOffload with MixedPrecision's
/// param_dtype), each tensor the optimizer steps for it (its flat shard, or
/// its use_orig_params pieces) with the same part of the unit's host copy in
/// the compute dtype, which each unshard then sends to the GPU instead of the
/// fp32 shard while it is as new as the shard. Fills the copies from the
/// shards. What fsdp::optim::FusedAdamW::write_compute_copies registers (Note
/// [A host copy in the compute dtype] in src/core/flat_parameter.cpp).
std::vector<std::pair<at::Tensor, at::Tensor>> offloaded_compute_copies(torch::nn::Module& model);

}  // namespace fsdp
