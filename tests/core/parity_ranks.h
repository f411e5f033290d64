#pragma once

// The parity tests' frame, apart from test_models.h, which programs without
// the multi-rank harness include too.

#include <torch/torch.h>

#include <chrono>
#include <functional>

#include <fsdp/fsdp.h>

#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {

/// Runs `body` in the ranks of every parity world size, each with one
/// intra-op thread and the default process group.
inline void in_parity_ranks(const std::function<void()>& body) {
  for (const int world : parity_world_sizes()) {
    run_ranks_ok(world, [&body](int, int) {
      torch::set_num_threads(1);
      init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
      body();
    });
  }
}

}  // namespace fsdp::testing
