#pragma once

// The GPU tests' device for a rank: where launchers put it, so that the same
// tests run with every rank on one GPU (the ranks share it over CUDA IPC)
// and, on a machine with several, rank k on GPU k (NCCL between them).

#include <torch/types.h>

#include <fsdp/comm/init.h>

namespace fsdp::testing {

/// fsdp::local_gpu() once init_process_group ran, else GPU 0.
inline torch::Device rank_gpu() {
  const std::optional<c10::Device> gpu = is_initialized() ? local_gpu() : std::nullopt;
  return gpu ? *gpu : torch::Device(torch::kCUDA, 0);
}

/// rank_gpu()'s index, for the allocator's statistics.
inline int rank_gpu_index() { return rank_gpu().index(); }

}  // namespace fsdp::testing
