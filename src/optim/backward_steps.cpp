#include "optim/backward_steps.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "core/device_streams.h"
#include "detail/error.h"

// See Note [Stepping beside backward] in backward_steps.h.

namespace fsdp::detail {

namespace {

using Clock = std::chrono::steady_clock;

// BackwardStepTimes' sums, in nanoseconds.
struct TimeSums {
  std::atomic<int64_t> span{0}, complete{0}, arrive{0}, step{0}, step_wait{0};
};
TimeSums& time_sums() {
  static TimeSums sums;
  return sums;
}

void add(std::atomic<int64_t>& sum, Clock::time_point from, Clock::time_point to) {
  sum += std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count();
}

// Runs `f`, adding its time to `sum`; when it ended.
template <typename F>
Clock::time_point timed(std::atomic<int64_t>& sum, F&& f) {
  const Clock::time_point from = Clock::now();
  f();
  const Clock::time_point to = Clock::now();
  add(sum, from, to);
  return to;
}

double take_ms(std::atomic<int64_t>& sum) { return static_cast<double>(sum.exchange(0)) / 1e6; }

// BackwardStepEvent's record.
struct EventLog {
  std::atomic<bool> on{false};
  std::mutex mutex;
  std::vector<BackwardStepEvent> events;
};
EventLog& event_log() {
  static EventLog log;
  return log;
}

}  // namespace

BackwardStepTimes take_backward_step_times() {
  TimeSums& sums = time_sums();
  BackwardStepTimes t;
  t.span_ms = take_ms(sums.span);
  t.complete_ms = take_ms(sums.complete);
  t.arrive_ms = take_ms(sums.arrive);
  t.step_ms = take_ms(sums.step);
  t.step_wait_ms = take_ms(sums.step_wait);
  return t;
}

void record_backward_step_events(bool on) { event_log().on = on; }

std::vector<BackwardStepEvent> take_backward_step_events() {
  EventLog& log = event_log();
  std::lock_guard<std::mutex> lock(log.mutex);
  return std::exchange(log.events, {});
}

BackwardSteps::BackwardSteps(std::string owner, StepRange step_range,
                             std::function<void()> on_taken)
    : owner_(std::move(owner)),
      step_range_(std::move(step_range)),
      on_taken_(std::move(on_taken)) {}

namespace {
std::atomic<int> g_attached{0};
}  // namespace

int backward_steps_attached() { return g_attached.load(); }

BackwardSteps::~BackwardSteps() {
  g_attached -= attached_;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void BackwardSteps::attach(torch::nn::Module& model) {
  ++attached_;
  ++g_attached;
  // The hooks hold the optimizer's half weakly: an optimizer destroyed
  // before its model leaves hooks that act as if removed (listening).
  std::weak_ptr<BackwardSteps> self = shared_from_this();
  ReducedGradHooks hooks;
  hooks.owner = owner_;
  hooks.on_reduced = [self](ReducedGrad grad) {
    if (auto steps = self.lock()) steps->hand_over(std::move(grad));
  };
  hooks.before_forward = [self] {
    if (auto steps = self.lock()) steps->before_forward();
  };
  hooks.before_backward = [self] {
    if (auto steps = self.lock()) steps->before_backward();
  };
  hooks.before_zero_grad = [self] {
    if (auto steps = self.lock()) steps->wait();
  };
  hooks.after_backward = [self] {
    if (auto steps = self.lock()) steps->after_backward();
  };
  hooks.before_state_use = [self] {
    if (auto steps = self.lock()) steps->before_state_use();
  };
  hooks.listening = [self] { return !self.expired(); };
  hooks.takes_parts = true;  // each part stepped as it lands
  set_reduced_grad_hooks(model, hooks);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
}

void BackwardSteps::hand_over(ReducedGrad grad) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const at::Tensor& p : grad.params) {
      // Each parameter once per step: before_backward() refuses a second
      // backward before step(), before_forward() a second forward, so only
      // a unit reducing twice within one backward reaches this guard.
      // Every rank hands the same units over in the same order, so every
      // rank fails here alike, before the second step of the same shard.
      FSDP_CHECK(stepped_.insert(p.unsafeGetTensorImpl()).second, -1, owner_,
                 "one backward handed the same parameter's reduced gradient over twice, which "
                 "would step its shard twice; this is a libfsdp fault (a second backward "
                 "before step() is refused as it begins): please report it with the model's "
                 "units");
    }
    const Clock::time_point now = Clock::now();
    if (phase_ == Phase::kIdle) {  // this backward's first
      set_phase(Phase::kInBackward);
      first_handed_ = now;
    }
    queue_.push_back(Handed{std::move(grad), now});
  }
  changed_.notify_all();
}

void BackwardSteps::set_phase(Phase next) {
  const bool ok = next == Phase::kIdle || (phase_ == Phase::kIdle && next == Phase::kInBackward) ||
                  (phase_ == Phase::kInBackward && next == Phase::kEnded);
  TORCH_INTERNAL_ASSERT(ok, owner_, ": no step phase transition ", static_cast<int>(phase_), " -> ",
                        static_cast<int>(next));
  phase_ = next;
}

void BackwardSteps::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [this] { return queue_.empty() && !busy_; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void BackwardSteps::before_forward() { refuse_before_step("forward", ""); }

void BackwardSteps::before_backward() {
  // The worker may still be writing the last backward's shards, which this
  // one would gather (a data race ThreadSanitizer found: a second backward
  // through a retained graph read them while they were stepped).
  refuse_before_step("backward",
                     " (a second backward through a retained graph, or one inside no_sync() "
                     "after it)");
}

void BackwardSteps::after_backward() {
  timed(time_sums().step_wait, [this] { wait(); });
  std::lock_guard<std::mutex> lock(mutex_);
  if (phase_ == Phase::kInBackward) set_phase(Phase::kEnded);
}

void BackwardSteps::before_replaced() {
  refuse_before_step("step_during_backward() call",
                     " (attaching again would forget what it stepped, and step() would step "
                     "it twice)");
}

void BackwardSteps::before_state_use() {
  // Between such a backward and step() some shards hold the values after
  // the step and the others those before it, and the worker may still be
  // writing them: no state that plain LibTorch would have at any point.
  refuse_before_step("state dict, checkpoint, SummonFullParams or torch::save/load of the model",
                     " (the stepped units' shards would mix with the others' from before the "
                     "step)");
}

void BackwardSteps::before_optimizer_state_use() {
  // The same for the optimizer's own state: some parameters' at the step
  // after, the others' at the step before, the worker maybe inserting into it.
  refuse_before_step("torch::save/load of the optimizer",
                     " (the stepped parameters' state would mix with the others' from before "
                     "the step)");
}

void BackwardSteps::refuse_before_step(const char* pass, const char* cases) {
  wait();
  std::lock_guard<std::mutex> lock(mutex_);
  // Every rank runs the same forwards and backwards, and hands the same units
  // over, so every rank fails here alike, before any collective of the pass.
  // A backward that threw midway (on one rank, maybe) never ended: its
  // stepped units cannot be unstepped, so step() closes that step.
  FSDP_CHECK(phase_ != Phase::kInBackward, -1, owner_, "a ", pass,
             " began after a backward that stopped midway (it threw) once some of its units "
             "were stepped during it; call step() to close that step (the units it did not "
             "reach keep their values, as under PyTorch's optimizer-in-backward), then go on, "
             "or load a checkpoint after it to undo that step");
  FSDP_CHECK(phase_ == Phase::kIdle, -1, owner_, "a ", pass,
             " began after a backward whose gradients were stepped, with no step() in between",
             cases,
             "; stepping during backward makes each backward one optimizer step: call step() "
             "after every backward, and accumulate gradients over several backwards inside "
             "model->no_sync(), the last one outside (or, under hybrid sharding, with "
             "model->set_requires_all_reduce(false) before all but the last)");
}

std::unordered_set<const c10::TensorImpl*> BackwardSteps::take_stepped() {
  wait();
  if (on_taken_) on_taken_();
  std::lock_guard<std::mutex> lock(mutex_);
  if (phase_ != Phase::kIdle) add(time_sums().span, first_handed_, last_stepped_);
  set_phase(Phase::kIdle);
  return std::exchange(stepped_, {});
}

void BackwardSteps::run() {
  at::init_num_threads();  // the intra-op thread count set for LibTorch
  torch::NoGradGuard no_grad;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and nothing left
    std::exception_ptr error;
    {
      Handed handed = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      try {
        step(handed);
      } catch (...) {
        error = std::current_exception();
      }
    }  // the gradient's buffers (a GPU's reduced shard) let go before wait() returns
    lock.lock();
    if (error && !error_) error_ = error;
    busy_ = false;
    last_stepped_ = Clock::now();
    changed_.notify_all();
  }
}

void BackwardSteps::step(Handed& handed) {
  ReducedGrad& grad = handed.grad;
  // Ordered as backward's work is, before the next forward's (the user's
  // stream, not this thread's default one), on the unit's device.
  const OnStream on_backwards_stream(grad.stream);
  TimeSums& sums = time_sums();
  BackwardStepEvent event;
  event.handed = handed.at;
  event.completed = grad.complete ? timed(sums.complete, grad.complete) : Clock::now();
  event.landed = event.stepped = event.completed;
  // Each range stepped, then handed back (ReducedGrad::stepped).
  const auto step_range = [&](const ParamRange& r) {
    step_range_(grad.params[r.param], r.begin, r.end);
    if (grad.stepped) grad.stepped(r);
  };
  if (grad.parts.empty()) {
    event.stepped = timed(sums.step, [&] {
      for (size_t i = 0; i < grad.params.size(); ++i) step_range({i, 0, grad.params[i].numel()});
    });
  }
  for (const GradPart& part : grad.parts) {  // Note [Stepping a gradient as it lands]
    event.landed = timed(sums.arrive, part.arrived);
    event.stepped = timed(sums.step, [&] {
      for (const ParamRange& r : part.ranges) step_range(r);
    });
  }
  EventLog& log = event_log();
  if (!log.on) return;
  for (const at::Tensor& p : grad.params) event.elements += p.numel();
  std::lock_guard<std::mutex> lock(log.mutex);
  log.events.push_back(event);
}

}  // namespace fsdp::detail
