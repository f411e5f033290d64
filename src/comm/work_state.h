#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp::detail {

/// Shared state behind a fsdp::Work: pending until the communication thread
/// finishes the collective, then succeeded or failed (never back).
struct WorkState {
  /// Lifecycle; the only transitions are kPending -> kSucceeded | kFailed.
  enum class Status { kPending, kSucceeded, kFailed };

  WorkState(std::string description, int rank, std::chrono::milliseconds wait_limit,
            std::vector<at::Tensor> tensors)
      : description(std::move(description)),
        rank(rank),
        wait_limit(wait_limit),
        tensors(std::move(tensors)) {}

  /// Records the outcome (error == nullptr: success) and wakes waiters.
  void finish(std::exception_ptr error);

  // Constant after construction.
  const std::string description;  // "all_gather #12 (4096 x Float)"
  const int rank;
  const std::chrono::milliseconds wait_limit;  // group timeout plus grace

  // State below is protected by mutex.
  std::mutex mutex;
  std::condition_variable done;
  Status status = Status::kPending;
  std::exception_ptr error;
  std::vector<at::Tensor> tensors;  // kept alive until the collective finished

  /// Set before the Work is handed out: runs the collective on the calling
  /// thread if it may (Note [Running on the waiter] in comm_thread.h).
  std::function<bool(const WorkState*)> run_here;
};

}  // namespace fsdp::detail
