#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <fsdp/comm/work.h>

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

  /// Records the outcome (error == nullptr: success), wakes waiters, then
  /// runs the continuations on this thread. Continuations must not throw.
  void finish(const std::exception_ptr& error);

  /// Runs `next` with the outcome once the collective finished: at once on
  /// this thread if it has, else on the thread that finishes it.
  void then(std::function<void(std::exception_ptr)> next);

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
  std::vector<std::function<void(std::exception_ptr)>> continuations;  // see then()

  /// Set before the Work is handed out: runs the collective on the calling
  /// thread if it may (Note [Running on the waiter] in comm_thread.h), or,
  /// for one the GPU runs, asks for an early look at its end (NCCL's
  /// completion polling). Called by wait(); true if it ran the collective.
  std::function<bool(const WorkState*)> run_here;

  /// Set before the Work is handed out by a collective that runs on a GPU
  /// stream: makes the caller's current stream wait for it (Work::
  /// block_current_stream()). Unset: the host waits instead.
  std::function<void()> stream_wait;
};

/// libfsdp's access to the state behind a Work.
struct WorkAccess {
  /// The handle's state (nullptr for an empty handle).
  static const std::shared_ptr<WorkState>& state(const Work& work) { return work.state_; }
};

/// A Work for `first` followed by the collective `second` issues: `second` is
/// called the moment `first` succeeds, on the thread that completed it (a
/// communication thread, or a waiter running it), so a chain of collectives
/// on different groups proceeds without anyone waiting in between. Chains
/// whose firsts run on one group in issue order issue their seconds in that
/// order too, the same on every rank. The result fails with the first error
/// of either; `tensors` stay alive until it finished.
Work chain_work(const Work& first, std::function<Work()> second, const std::string& description,
                std::vector<at::Tensor> tensors);

/// Whether a stream can wait for `work` (Work::block_current_stream() then
/// does not block the host): a collective that runs on a GPU stream.
inline bool stream_can_wait(const Work& work) {
  const auto& state = WorkAccess::state(work);
  return state != nullptr && static_cast<bool>(state->stream_wait);
}

/// A Work that has already succeeded (for a step with nothing to wait for).
Work finished_work(const std::string& description, int rank);

/// A Work for `first` followed by `after` (a host-side step such as copying
/// a result back), run on the thread that completed `first` the moment it
/// succeeded. The result fails with `first`'s error, or with what `after`
/// threw; `tensors` stay alive until it finished.
Work then_run(const Work& first, std::function<void()> after, const std::string& description,
              std::vector<at::Tensor> tensors);

}  // namespace fsdp::detail
