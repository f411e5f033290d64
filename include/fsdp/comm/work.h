#pragma once

#include <chrono>
#include <exception>
#include <memory>
#include <string>

namespace fsdp {

namespace detail {
struct WorkState;
struct WorkAccess;  // libfsdp's own access to the state (src/comm/work_state.h)
}  // namespace detail

/// Handle to an asynchronous collective. Collectives on one group run in the
/// order they were issued; handles may be waited in any order. A Work keeps
/// the tensors it reads and writes alive until it completes.
class Work {
 public:
  /// An empty handle; waiting on it is an error.
  Work() = default;
  /// Wraps shared state created by a ProcessGroup implementation.
  explicit Work(std::shared_ptr<detail::WorkState> state);

  /// Blocks until the collective completed. Rethrows its error (a c10::Error
  /// naming the rank, the collective and the cause). Never blocks longer than
  /// the group's timeout plus a grace period: past that it throws.
  void wait() const;

  /// Like wait(), with an explicit limit.
  void wait(std::chrono::milliseconds timeout) const;

  /// Makes the caller's current CUDA stream wait for the collective, without
  /// blocking the host, where the collective runs on the GPU (NCCL): kernels
  /// the caller launches afterwards see its result. For a collective the host
  /// carries (CPU tensors, or GPU tensors staged through host memory), the
  /// same as wait(). Rethrows an error the collective already reported.
  void block_current_stream() const;

  /// True once the collective finished, successfully or not.
  bool is_completed() const;

  /// True once the collective finished without an error.
  bool is_success() const;

  /// A short description ("all_gather #12 (4096 x Float)"), for messages.
  std::string describe() const;

  /// True for a handle that refers to a collective.
  explicit operator bool() const { return state_ != nullptr; }

 private:
  friend struct detail::WorkAccess;
  std::shared_ptr<detail::WorkState> state_;
};

}  // namespace fsdp
