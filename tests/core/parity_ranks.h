#pragma once

// The parity tests' frame, apart from test_models.h, which programs without
// the multi-rank harness include too.

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <memory>

#include <fsdp/fsdp.h>

#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {

/// In a rank process: one intra-op thread, and the default process group
/// joined with a 30 s limit (returned).
inline std::shared_ptr<ProcessGroup> join_test_group() {
  torch::set_num_threads(1);
  return init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
}

/// Runs `body` in the ranks of every parity world size, each joined by
/// join_test_group().
inline void in_parity_ranks(const std::function<void()>& body) {
  for (const int world : parity_world_sizes()) {
    run_ranks_ok(world, [&body](int, int) {
      join_test_group();
      body();
    });
  }
}

}  // namespace fsdp::testing
