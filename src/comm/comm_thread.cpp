#include "comm/comm_thread.h"

#include <c10/util/Exception.h>

#include <sstream>

#include "comm/work_state.h"

namespace fsdp::detail {

std::string describe_tensor(const at::Tensor& t) {
  std::ostringstream os;
  os << t.numel() << " x " << t.scalar_type();
  return os.str();
}

namespace {
// Beyond the collective's own timeout, how long wait() gives the engine to
// report it before declaring the collective lost.
constexpr auto kWaitGrace = std::chrono::seconds(5);
}  // namespace

CommThread::CommThread(int rank, std::chrono::milliseconds timeout)
    : rank_(rank), timeout_(timeout), thread_([this] { loop(); }) {}

CommThread::~CommThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

uint64_t CommThread::issued() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return seq_;
}

CommThread::Item CommThread::make_item(CollectiveKind kind, const std::string& what,
                                       std::vector<at::Tensor> tensors,
                                       std::function<void(uint64_t)> body) {
  Item item;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    item.seq = seq_++;
  }
  std::ostringstream os;
  os << to_string(kind) << " #" << item.seq;
  if (!what.empty()) os << " (" << what << ")";
  item.state =
      std::make_shared<WorkState>(os.str(), rank_, timeout_ + kWaitGrace, std::move(tensors));
  item.body = std::move(body);
  return item;
}

Work CommThread::enqueue(CollectiveKind kind, const std::string& what,
                         std::vector<at::Tensor> tensors, std::function<void(uint64_t)> body) {
  Item item = make_item(kind, what, std::move(tensors), std::move(body));
  Work work(item.state);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(item));
  }
  wake_.notify_one();
  return work;
}

Work CommThread::run_inline(CollectiveKind kind, const std::string& what,
                            std::vector<at::Tensor> tensors,
                            const std::function<void(uint64_t)>& body) {
  Item item = make_item(kind, what, std::move(tensors), body);
  execute(item);
  return Work(item.state);
}

void CommThread::execute(Item& item) {
  if (health_ == Health::kBroken) {
    item.state->finish(std::make_exception_ptr(
        c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                   "[rank " + std::to_string(rank_) + "] fsdp: " + item.state->description +
                       " not run: the process group broke earlier (" + broken_cause_ +
                       "). Restart the job; fsdprun --max-restarts does it automatically.")));
    return;
  }
  try {
    item.body(item.seq);
    item.state->finish(nullptr);
  } catch (const std::exception& e) {
    health_ = Health::kBroken;
    broken_cause_ = item.state->description + ": " + e.what();
    item.state->finish(std::make_exception_ptr(c10::Error(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
        "[rank " + std::to_string(rank_) + "] fsdp: " + item.state->description +
            " failed: " + e.what() +
            ". A peer rank has probably died or timed out; look at the other ranks' output.")));
  }
}

void CommThread::loop() {
  while (true) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    execute(item);
  }
}

}  // namespace fsdp::detail
