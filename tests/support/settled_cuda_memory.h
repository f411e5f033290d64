#pragma once

// The CUDA caching allocator's bytes in use once asynchronous bookkeeping has
// let go of finished work, for the GPU tests' memory assertions.

#include <torch/cuda.h>

#include <chrono>
#include <cstdint>
#include <thread>

#include "detail/torch_compat.h"

namespace fsdp::testing {

/// Bytes in use on GPU `device` after synchronising it, read until the count
/// has not moved for 250 ms (at most 3 s): libfsdp's NCCL completion thread
/// drops a finished collective's tensors within a millisecond, and c10d hands
/// back those of a collective waited for on the host only at its watchdog's
/// pace (Note [NCCL collectives and their Work]). A 1 KiB agreement tensor
/// was seen still held after one step in three on an H100.
inline int64_t settled_cuda_allocated(int device = 0) {
  using Clock = std::chrono::steady_clock;
  torch::cuda::synchronize(device);
  int64_t last = compat::cuda_memory(device).allocated;
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  auto since = Clock::now();
  while (Clock::now() < deadline && Clock::now() - since < std::chrono::milliseconds(250)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const int64_t now = compat::cuda_memory(device).allocated;
    if (now != last) {
      last = now;
      since = Clock::now();
    }
  }
  return last;
}

}  // namespace fsdp::testing
