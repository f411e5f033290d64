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

/// Lifecycle of the group's health; see Note [Broken groups].
enum class Health { kHealthy, kBroken };

struct CommThread::Core {
  struct Item {
    std::shared_ptr<WorkState> state;
    uint64_t seq = 0;
    std::function<void(uint64_t)> body;
  };

  Core(int rank, std::chrono::milliseconds timeout) : rank(rank), timeout(timeout) {}

  Item make_item(CollectiveKind kind, const std::string& what, std::vector<at::Tensor> tensors,
                 std::function<void(uint64_t)> body);
  void execute(Item& item);
  void loop();
  bool try_run(const WorkState* state);

  // Constant after construction.
  const int rank;
  const std::chrono::milliseconds timeout;

  // State below is protected by mutex.
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<Item> queue;
  bool running = false;  // a collective is executing (on the thread or a waiter)
  bool stopping = false;
  uint64_t seq = 0;

  // Touched only by whoever runs collectives (one at a time: `running`).
  Health health = Health::kHealthy;
  std::string broken_cause;
};

CommThread::CommThread(int rank, std::chrono::milliseconds timeout)
    : core_(std::make_shared<Core>(rank, timeout)), thread_([core = core_] { core->loop(); }) {}

CommThread::~CommThread() {
  {
    std::lock_guard<std::mutex> lock(core_->mutex);
    core_->stopping = true;
  }
  core_->wake.notify_all();
  thread_.join();
}

uint64_t CommThread::issued() const {
  std::lock_guard<std::mutex> lock(core_->mutex);
  return core_->seq;
}

CommThread::Core::Item CommThread::Core::make_item(CollectiveKind kind, const std::string& what,
                                                   std::vector<at::Tensor> tensors,
                                                   std::function<void(uint64_t)> body) {
  Item item;
  {
    std::lock_guard<std::mutex> lock(mutex);
    item.seq = seq++;
  }
  std::ostringstream os;
  os << to_string(kind) << " #" << item.seq;
  if (!what.empty()) os << " (" << what << ")";
  item.state =
      std::make_shared<WorkState>(os.str(), rank, timeout + kWaitGrace, std::move(tensors));
  item.body = std::move(body);
  return item;
}

Work CommThread::enqueue(CollectiveKind kind, const std::string& what,
                         std::vector<at::Tensor> tensors, std::function<void(uint64_t)> body) {
  Core::Item item = core_->make_item(kind, what, std::move(tensors), std::move(body));
  std::weak_ptr<Core> weak = core_;
  item.state->run_here = [weak](const WorkState* state) {
    auto core = weak.lock();
    return core != nullptr && core->try_run(state);
  };
  Work work(item.state);
  {
    std::lock_guard<std::mutex> lock(core_->mutex);
    core_->queue.push_back(std::move(item));
  }
  core_->wake.notify_one();
  return work;
}

Work CommThread::run_inline(CollectiveKind kind, const std::string& what,
                            std::vector<at::Tensor> tensors,
                            const std::function<void(uint64_t)>& body) {
  Core::Item item = core_->make_item(kind, what, std::move(tensors), body);
  core_->execute(item);
  return Work(item.state);
}

void CommThread::Core::execute(Item& item) {
  if (health == Health::kBroken) {
    item.state->finish(std::make_exception_ptr(
        c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                   "[rank " + std::to_string(rank) + "] fsdp: " + item.state->description +
                       " not run: the process group broke earlier (" + broken_cause +
                       "). Restart the job; fsdprun --max-restarts does it automatically.")));
    return;
  }
  try {
    item.body(item.seq);
    item.state->finish(nullptr);
  } catch (const std::exception& e) {
    health = Health::kBroken;
    broken_cause = item.state->description + ": " + e.what();
    item.state->finish(std::make_exception_ptr(c10::Error(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
        "[rank " + std::to_string(rank) + "] fsdp: " + item.state->description +
            " failed: " + e.what() +
            ". A peer rank has probably died or timed out; look at the other ranks' output.")));
  }
}

bool CommThread::Core::try_run(const WorkState* state) {
  Item item;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (running || queue.empty() || queue.front().state.get() != state) return false;
    item = std::move(queue.front());
    queue.pop_front();
    running = true;
  }
  execute(item);
  {
    std::lock_guard<std::mutex> lock(mutex);
    running = false;
  }
  wake.notify_one();  // collectives queued behind this one are the thread's again
  return true;
}

void CommThread::Core::loop() {
  while (true) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mutex);
      wake.wait(lock, [&] { return (stopping && !running) || (!queue.empty() && !running); });
      if (queue.empty()) return;  // stopping and drained
      item = std::move(queue.front());
      queue.pop_front();
      running = true;
    }
    execute(item);
    std::lock_guard<std::mutex> lock(mutex);
    running = false;
  }
}

}  // namespace fsdp::detail
