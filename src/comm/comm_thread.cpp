#include "comm/comm_thread.h"

#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <sstream>

#include <fsdp/error_message.h>

#include "comm/agreement.h"
#include "comm/mismatch.h"
#include "comm/thread_priority.h"
#include "comm/work_state.h"
#include "detail/error.h"
#include "detail/inference_mode.h"

// Note [Collective fingerprints]
// Ranks that issue different collectives (another operation, size or dtype)
// at the same point pair them up wrongly: the engine waits for a message that
// never comes (a hang until the timeout) or, when the byte counts happen to
// match, mixes unrelated tensors silently. In debug mode (ProcessGroupOptions
// debug_collectives, or FSDP_DEBUG=detail) every collective is preceded by an
// all-gather of a fixed-size fingerprint: sequence number, operation, dtype,
// element count and reduce op or root. Being fixed-size, that exchange pairs
// up correctly whatever the collectives are, so every rank sees every other
// rank's fingerprint and all of them raise the same error, naming the ranks
// and their fingerprints, before the real collective starts. The exchange
// runs on the engine's point-to-point channel under slots of its own, so it
// never collides with the collectives' messages. It costs one small ring
// all-gather (size - 1 latency steps) per collective. A rank that issues no
// collective at all still makes the others wait until the timeout.

namespace fsdp::detail {

std::string describe_tensor(const at::Tensor& t) {
  std::ostringstream os;
  os << t.numel() << " x " << t.scalar_type();
  return os.str();
}

std::string describe_collective(CollectiveKind kind, uint64_t seq, const std::string& what) {
  std::ostringstream os;
  os << to_string(kind) << " #" << seq;
  if (!what.empty()) os << " (" << what << ")";
  return os.str();
}

std::vector<int64_t> Fingerprint::values() const {
  return {static_cast<int64_t>(seq), static_cast<int64_t>(kind), dtype, numel, detail};
}

Fingerprint Fingerprint::from_row(const int64_t* row) {
  Fingerprint f;
  f.seq = static_cast<uint64_t>(row[0]);
  f.kind = static_cast<CollectiveKind>(row[1]);
  f.dtype = row[2];
  f.numel = row[3];
  f.detail = row[4];
  return f;
}

bool Fingerprint::operator==(const Fingerprint& o) const {
  return seq == o.seq && kind == o.kind && dtype == o.dtype && numel == o.numel &&
         detail == o.detail;
}

std::string Fingerprint::to_string() const {
  std::ostringstream os;
  const auto k = static_cast<int64_t>(kind);
  if (k >= 0 && k <= static_cast<int64_t>(CollectiveKind::kBarrier)) {
    os << fsdp::to_string(kind);
  } else {
    os << "collective kind " << k;
  }
  os << " #" << seq << " (";
  if (dtype >= 0) {
    os << numel << " x " << static_cast<at::ScalarType>(dtype);
  } else {
    os << "no tensor";
  }
  if (detail >= 0 &&
      (kind == CollectiveKind::kReduceScatter || kind == CollectiveKind::kAllReduce) &&
      detail <= static_cast<int64_t>(ReduceOp::kMin)) {
    os << ", " << fsdp::to_string(static_cast<ReduceOp>(detail));
  } else if (detail >= 0 && kind == CollectiveKind::kBroadcast) {
    os << ", root " << detail;
  }
  os << ")";
  return os.str();
}

namespace {}  // namespace

/// Lifecycle of the group's health; see Note [Broken groups].
enum class Health { kHealthy, kBroken };

struct CommThread::Core {
  struct Item {
    std::shared_ptr<WorkState> state;
    Fingerprint fingerprint;
    bool check = false;  // debug mode was on when it was issued
    // Issued under c10::InferenceMode: runs under it (Note [Inference mode]).
    bool inference = false;
    std::function<void(uint64_t)> body;
  };

  Core(int rank, std::chrono::milliseconds timeout) : rank(rank), timeout(timeout) {}

  Item make_item(CollectiveKind kind, const std::string& what, std::vector<at::Tensor> tensors,
                 int64_t detail, std::function<void(uint64_t)> body);
  // The mismatch message, or "" when every rank sent the same fingerprint.
  std::string check_fingerprints(const Item& item);
  void execute(Item& item);
  // Finishes the item with a c10::Error carrying message.
  void fail(Item& item, const std::string& message);
  void loop();
  bool try_run(const WorkState* state);
  // Pops the queue's front and marks it running (mutex held).
  Item take_front();
  // Executes a taken item, then clears `running`.
  void run_taken(Item& item);

  // Constant after construction.
  const int rank;
  const std::chrono::milliseconds timeout;
  FingerprintExchange exchange;     // set before debug mode is first on
  std::function<void()> on_broken;  // set before any collective
  // health becomes kBroken for `cause`; the caller reports the failure,
  // then close_broken() runs the group's on_broken (closing Gloo's pairs
  // waits a device-loop tick per pair: seconds at hundreds of ranks, which
  // must not delay the error past Work::wait's grace).
  void become_broken(std::string cause);
  void close_broken();
  std::atomic<bool> debug{false};

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

CommThread::CommThread(int rank, std::chrono::milliseconds timeout, bool realtime)
    : core_(std::make_shared<Core>(rank, timeout)), thread_([core = core_, realtime] {
        prefer_over_compute(realtime);
        core->loop();
      }) {}

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

void CommThread::set_fingerprint_exchange(FingerprintExchange exchange) {
  core_->exchange = std::move(exchange);
}

void CommThread::set_on_broken(std::function<void()> on_broken) {
  core_->on_broken = std::move(on_broken);
}

void CommThread::Core::become_broken(std::string cause) {
  health = Health::kBroken;
  broken_cause = std::move(cause);
}

void CommThread::Core::close_broken() {
  if (!on_broken) return;
  try {
    on_broken();
  } catch (...) {  // NOLINT(bugprone-empty-catch): closing links may fail; the group is broken
  }
}

void CommThread::set_debug(bool on) {
  TORCH_INTERNAL_ASSERT(!on || core_->exchange, "fsdp: debug mode needs a fingerprint exchange");
  core_->debug.store(on);
}

bool CommThread::debug() const { return core_->debug.load(); }

CommThread::Core::Item CommThread::Core::make_item(CollectiveKind kind, const std::string& what,
                                                   std::vector<at::Tensor> tensors, int64_t detail,
                                                   std::function<void(uint64_t)> body) {
  Item item;
  {
    std::lock_guard<std::mutex> lock(mutex);
    item.fingerprint.seq = seq++;
  }
  item.fingerprint.kind = kind;
  item.fingerprint.detail = detail;
  if (!tensors.empty()) {
    item.fingerprint.dtype = static_cast<int64_t>(tensors[0].scalar_type());
    item.fingerprint.numel = tensors[0].numel();
  }
  item.check = debug.load();
  item.inference = c10::InferenceMode::is_enabled();
  item.state = std::make_shared<WorkState>(describe_collective(kind, item.fingerprint.seq, what),
                                           rank, timeout + kWaitGrace, std::move(tensors));
  item.body = std::move(body);
  return item;
}

Work CommThread::enqueue(CollectiveKind kind, const std::string& what,
                         std::vector<at::Tensor> tensors, int64_t detail,
                         std::function<void(uint64_t)> body) {
  Core::Item item = core_->make_item(kind, what, std::move(tensors), detail, std::move(body));
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
                            std::vector<at::Tensor> tensors, int64_t detail,
                            const std::function<void(uint64_t)>& body) {
  Core::Item item = core_->make_item(kind, what, std::move(tensors), detail, body);
  item.check = false;  // a single rank has nobody to disagree with
  core_->execute(item);
  return Work(item.state);
}

std::string CommThread::Core::check_fingerprints(const Item& item) {
  const Fingerprint& mine = item.fingerprint;
  // The exchange runs on the engine's host channel: the fingerprint stays on
  // the CPU whatever the group's device (Note [Cross-rank agreement]).
  const std::vector<int64_t> all =
      small_values(exchange(small_tensor(mine.values(), at::kLong, at::kCPU), mine.seq));
  const auto size = static_cast<int64_t>(all.size()) / Fingerprint::kFields;
  const int64_t* rows = all.data();
  // Ranks grouped by the fingerprint they sent, in rank order of first sight.
  std::vector<std::pair<Fingerprint, std::vector<int64_t>>> groups;
  for (int64_t r = 0; r < size; ++r) {
    const Fingerprint f = Fingerprint::from_row(rows + r * Fingerprint::kFields);
    auto it =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == f; });
    if (it == groups.end()) {
      groups.push_back({f, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  if (groups.size() == 1) return "";
  std::ostringstream os;
  os << error_prefix(rank, "process group") << "collective mismatch (debug mode) at collective #"
     << mine.seq << " of the group: ";
  for (size_t i = 0; i < groups.size(); ++i) {
    const auto& ranks = groups[i].second;
    os << (i > 0 ? "; " : "") << (ranks.size() > 1 ? "ranks " : "rank ");
    for (size_t j = 0; j < ranks.size(); ++j) os << (j > 0 ? ", " : "") << ranks[j];
    os << " issued " << groups[i].first.to_string();
  }
  os << ". Every rank must issue the same collectives, with the same sizes and dtypes, in the "
        "same order; the collective was not run, and the group is now broken. Look for "
        "rank-dependent control flow around this point (for FSDP units: a forward order or "
        "a set of trainable parameters that differs between ranks).";
  return os.str();
}

// The error is built, and its temporary destroyed, before finish() publishes
// it: a temporary outliving finish() would drop its share of c10::Error's
// message while a waiter already frees the exception inside libc10, which
// ThreadSanitizer cannot see synchronise (stop 36's CI failure).
void CommThread::Core::fail(Item& item, const std::string& message) {
  const std::exception_ptr error = std::make_exception_ptr(
      c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message));
  item.state->finish(error);
}

void CommThread::Core::execute(Item& item) {
  if (health == Health::kBroken) {
    fail(item, error_prefix(rank, "process group") + item.state->description +
                   " not run: the process group broke earlier (" + broken_cause +
                   "). Restart the job; fsdprun --max-restarts does it automatically.");
    return;
  }
  try {
    // A failure of the exchange itself (a peer died or timed out) is
    // reported like a failure of the collective, below.
    const std::string mismatch = item.check ? check_fingerprints(item) : "";
    if (!mismatch.empty()) {
      become_broken(item.state->description + ": collective mismatch");
      fail(item, mismatch);
      close_broken();
      return;
    }
    {
      // Under the mode it was issued under, whichever thread runs it, its
      // continuations (copies back to the caller's tensors) too (Note
      // [Inference mode]).
      std::optional<c10::InferenceMode> inference;
      std::optional<OutsideInferenceMode> outside;
      if (item.inference) {
        inference.emplace();
      } else {
        outside.emplace();
      }
      // Collectives are not differentiable (c10d's write through storage):
      // a parameter all-reduced under the caller's NoGradGuard is written
      // in place whether this thread or the caller's wait() runs it.
      const at::NoGradGuard no_grad;
      item.body(item.fingerprint.seq);
      item.state->finish(nullptr);
    }
  } catch (const std::exception& e) {
    // The cause without its backtrace: this message is one sentence.
    const std::string cause = error_message(e);
    become_broken(item.state->description + ": " + cause);
    // A transport that saw the ranks differ says so and what to do; any
    // other failure most often means a peer is gone.
    const bool mismatch = cause.find(kMismatchAdvice) != std::string::npos;
    fail(item, error_prefix(rank, "process group") + item.state->description + " failed: " + cause +
                   (!cause.empty() && cause.back() == '.' ? "" : ".") +
                   (mismatch ? ""
                             : " A peer rank has probably died or timed out; look at the "
                               "other ranks' output."));
    close_broken();
  }
}

CommThread::Core::Item CommThread::Core::take_front() {
  Item item = std::move(queue.front());
  queue.pop_front();
  running = true;
  return item;
}

void CommThread::Core::run_taken(Item& item) {
  execute(item);
  std::lock_guard<std::mutex> lock(mutex);
  running = false;
}

bool CommThread::Core::try_run(const WorkState* state) {
  Item item;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (running || queue.empty() || queue.front().state.get() != state) return false;
    item = take_front();
  }
  run_taken(item);
  wake.notify_one();  // collectives queued behind this one are the thread's again
  return true;
}

void CommThread::Core::loop() {
  while (true) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mutex);
      wake.wait(lock, [&] { return !running && (stopping || !queue.empty()); });
      if (queue.empty()) return;  // stopping and drained
      item = take_front();
    }
    run_taken(item);
  }
}

}  // namespace fsdp::detail
