#pragma once

// The seed ports that run on a GPU too, as PyTorch's own versions of them do
// (issue 34): each takes the device to train on. The CPU's test entries call
// them with the CPU; test_cuda_seeds calls them with GPU 0.

#include <torch/types.h>

namespace fsdp::testing {

/// Seed 000: the 32 freezing-weights combinations against plain LibTorch,
/// at every parity world size.
void check_freezing_weights(const torch::Device& device);

/// Seed 002: a model built on the meta device and wrapped (always_wrap and
/// one unit; default init and param_init_fn) equals the same model built
/// on `device`, before and through training, at every parity world size.
void check_meta_init_simple(const torch::Device& device);

/// Seed 002's nested model, wrapped by auto_wrap and by enable_wrap.
void check_meta_init_nested(const torch::Device& device);

/// Seed 001: in the first iteration a rank of `world` (2 or 3) that gathers
/// another unit than rank 0 gets the agreement error on every rank, for
/// every strategy.
void check_first_iteration_order_error(const torch::Device& device, int world);

}  // namespace fsdp::testing
