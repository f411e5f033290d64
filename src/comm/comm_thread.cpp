#include "comm/comm_thread.h"

#include <c10/util/Exception.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <sstream>

#include "comm/work_state.h"

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

bool debug_requested_by_env() {
  const char* env = std::getenv("FSDP_DEBUG");
  if (env == nullptr) return false;
  std::string value(env);
  std::transform(value.begin(), value.end(), value.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return value == "detail";
}

at::Tensor Fingerprint::to_tensor() const {
  at::Tensor t = at::empty({kFields}, at::kLong);
  int64_t* p = t.data_ptr<int64_t>();
  p[0] = static_cast<int64_t>(seq);
  p[1] = static_cast<int64_t>(kind);
  p[2] = dtype;
  p[3] = numel;
  p[4] = detail;
  return t;
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

void CommThread::set_fingerprint_exchange(FingerprintExchange exchange) {
  exchange_ = std::move(exchange);
}

void CommThread::set_debug(bool on) {
  TORCH_INTERNAL_ASSERT(!on || exchange_, "fsdp: debug mode needs a fingerprint exchange");
  debug_.store(on);
}

CommThread::Item CommThread::make_item(CollectiveKind kind, const std::string& what,
                                       std::vector<at::Tensor> tensors, int64_t detail,
                                       std::function<void(uint64_t)> body) {
  Item item;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    item.fingerprint.seq = seq_++;
  }
  item.fingerprint.kind = kind;
  item.fingerprint.detail = detail;
  if (!tensors.empty()) {
    item.fingerprint.dtype = static_cast<int64_t>(tensors[0].scalar_type());
    item.fingerprint.numel = tensors[0].numel();
  }
  item.check = debug_.load();
  std::ostringstream os;
  os << to_string(kind) << " #" << item.fingerprint.seq;
  if (!what.empty()) os << " (" << what << ")";
  item.state =
      std::make_shared<WorkState>(os.str(), rank_, timeout_ + kWaitGrace, std::move(tensors));
  item.body = std::move(body);
  return item;
}

Work CommThread::enqueue(CollectiveKind kind, const std::string& what,
                         std::vector<at::Tensor> tensors, int64_t detail,
                         std::function<void(uint64_t)> body) {
  Item item = make_item(kind, what, std::move(tensors), detail, std::move(body));
  Work work(item.state);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(item));
  }
  wake_.notify_one();
  return work;
}

Work CommThread::run_inline(CollectiveKind kind, const std::string& what,
                            std::vector<at::Tensor> tensors, int64_t detail,
                            const std::function<void(uint64_t)>& body) {
  Item item = make_item(kind, what, std::move(tensors), detail, body);
  item.check = false;  // a single rank has nobody to disagree with
  execute(item);
  return Work(item.state);
}

std::string CommThread::check_fingerprints(const Item& item) {
  const Fingerprint& mine = item.fingerprint;
  const at::Tensor all = exchange_(mine.to_tensor(), mine.seq).contiguous();
  const int64_t size = all.size(0);
  const int64_t* rows = all.data_ptr<int64_t>();
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
  os << "[rank " << rank_ << "] fsdp: collective mismatch (debug mode) at collective #" << mine.seq
     << " of the group: ";
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
    // A failure of the exchange itself (a peer died or timed out) is
    // reported like a failure of the collective, below.
    const std::string mismatch = item.check ? check_fingerprints(item) : "";
    if (!mismatch.empty()) {
      health_ = Health::kBroken;
      broken_cause_ = item.state->description + ": collective mismatch";
      item.state->finish(std::make_exception_ptr(
          c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, mismatch)));
      return;
    }
    item.body(item.fingerprint.seq);
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
