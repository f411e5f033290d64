#include <fsdp/comm/work.h>

#include <c10/util/Exception.h>

#include "comm/work_state.h"
#include "detail/error.h"

namespace fsdp {

namespace detail {

void WorkState::finish(const std::exception_ptr& err) {
  std::vector<std::function<void(std::exception_ptr)>> next;
  {
    std::lock_guard<std::mutex> lock(mutex);
    TORCH_INTERNAL_ASSERT(status == Status::kPending, "Work finished twice: ", description);
    status = err ? Status::kFailed : Status::kSucceeded;
    error = err;
    tensors.clear();
    next.swap(continuations);
  }
  done.notify_all();
  for (auto& f : next) f(err);
}

void WorkState::then(std::function<void(std::exception_ptr)> next) {
  std::exception_ptr outcome;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (status == Status::kPending) {
      continuations.push_back(std::move(next));
      return;
    }
    outcome = error;
  }
  next(outcome);
}

Work chain_work(const Work& first, std::function<Work()> second, const std::string& description,
                std::vector<at::Tensor> tensors) {
  const auto& head = WorkAccess::state(first);
  TORCH_INTERNAL_ASSERT(head, "fsdp: chain_work after an empty Work");
  // The chain may wait for both: twice the first's limit bounds it.
  auto chained = std::make_shared<WorkState>(description, head->rank, 2 * head->wait_limit,
                                             std::move(tensors));
  // The waiter may run the first collective itself (Note [Running on the
  // waiter]), and then the second, which that issued.
  auto tail = std::make_shared<std::shared_ptr<WorkState>>();
  auto tail_mutex = std::make_shared<std::mutex>();
  chained->run_here = [head, tail, tail_mutex](const WorkState*) {
    if (head->run_here) head->run_here(head.get());
    std::shared_ptr<WorkState> t;
    {
      std::lock_guard<std::mutex> lock(*tail_mutex);
      t = *tail;
    }
    return t && t->run_here && t->run_here(t.get());
  };
  // Held strongly: the second collective is issued even when nobody keeps
  // the handle, or the peers that issue it would wait for this rank. (The
  // cycle through head's continuations ends when head finishes.)
  head->then(
      [out = chained, second = std::move(second), tail, tail_mutex](const std::exception_ptr& err) {
        if (err) return out->finish(err);
        try {
          Work next = second();
          const auto& state = WorkAccess::state(next);
          {
            std::lock_guard<std::mutex> lock(*tail_mutex);
            *tail = state;
          }
          state->then([out](const std::exception_ptr& e) { out->finish(e); });
        } catch (...) {
          out->finish(std::current_exception());
        }
      });
  return Work(chained);
}

Work finished_work(const std::string& description, int rank) {
  auto state = std::make_shared<WorkState>(description, rank, std::chrono::milliseconds(0),
                                           std::vector<at::Tensor>{});
  state->finish(nullptr);
  return Work(state);
}

Work then_run(const Work& first, std::function<void()> after, const std::string& description,
              std::vector<at::Tensor> tensors) {
  const int rank = WorkAccess::state(first) ? WorkAccess::state(first)->rank : -1;
  return chain_work(
      first,
      [after = std::move(after), description, rank] {
        after();
        return finished_work(description, rank);
      },
      description, std::move(tensors));
}

}  // namespace detail

Work::Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

void Work::wait() const {
  FSDP_CHECK(state_ != nullptr, -1, "process group", "Work::wait() on an empty handle");
  wait(state_->wait_limit);
}

void Work::wait(std::chrono::milliseconds timeout) const {
  FSDP_CHECK(state_ != nullptr, -1, "process group", "Work::wait() on an empty handle");
  // Running it here would hold this thread for as long as the collective
  // takes: a limit shorter than the group's is left to the thread's queue.
  if (state_->run_here && timeout >= state_->wait_limit) state_->run_here(state_.get());
  std::unique_lock<std::mutex> lock(state_->mutex);
  const bool finished = state_->done.wait_for(
      lock, timeout, [&] { return state_->status != detail::WorkState::Status::kPending; });
  FSDP_CHECK(finished, state_->rank, "process group", state_->description,
             " did not complete within ", timeout.count(),
             " ms. A peer rank has probably died, hangs, or issued a different collective; "
             "look at the other ranks' output (set FSDP_DEBUG=detail to compare collectives).");
  if (state_->error) std::rethrow_exception(state_->error);
}

void Work::block_current_stream() const {
  FSDP_CHECK(state_ != nullptr, -1, "process group",
             "Work::block_current_stream() on an empty handle");
  if (!state_->stream_wait) return wait();
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->error) std::rethrow_exception(state_->error);
  }
  state_->stream_wait();
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
