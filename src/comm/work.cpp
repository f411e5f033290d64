#include <fsdp/comm/work.h>

#include <c10/util/Exception.h>

#include "comm/work_state.h"
#include "detail/error.h"

namespace fsdp {

namespace detail {

void WorkState::finish(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    TORCH_INTERNAL_ASSERT(status == Status::kPending, "Work finished twice: ", description);
    status = err ? Status::kFailed : Status::kSucceeded;
    error = std::move(err);
    tensors.clear();
  }
  done.notify_all();
}

}  // namespace detail

Work::Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

void Work::wait() const {
  FSDP_CHECK(state_ != nullptr, -1, "process group", "Work::wait() on an empty handle");
  wait(state_->wait_limit);
}

void Work::wait(std::chrono::milliseconds timeout) const {
  FSDP_CHECK(state_ != nullptr, -1, "process group", "Work::wait() on an empty handle");
  if (state_->run_here) state_->run_here(state_.get());
  std::unique_lock<std::mutex> lock(state_->mutex);
  const bool finished = state_->done.wait_for(
      lock, timeout, [&] { return state_->status != detail::WorkState::Status::kPending; });
  FSDP_CHECK(finished, state_->rank, "process group", state_->description,
             " did not complete within ", timeout.count(),
             " ms. A peer rank has probably died, hangs, or issued a different collective; "
             "look at the other ranks' output (set FSDP_DEBUG=detail to compare collectives).");
  if (state_->error) std::rethrow_exception(state_->error);
}

bool Work::is_completed() const {
  FSDP_CHECK(state_ != nullptr, -1, "process group", "Work::is_completed() on an empty handle");
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->status != detail::WorkState::Status::kPending;
}

bool Work::is_success() const {
  FSDP_CHECK(state_ != nullptr, -1, "process group", "Work::is_success() on an empty handle");
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->status == detail::WorkState::Status::kSucceeded;
}

std::string Work::describe() const { return state_ ? state_->description : "(empty Work)"; }

}  // namespace fsdp
