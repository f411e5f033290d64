#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <fsdp/runtime/reduced_grad_hooks.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

namespace fsdp::detail {

// Note [Stepping beside backward]
// The optimizer's half of Note [Steps during backward]
// (runtime/root_state.cpp): FSDP hands over each unit's reduced gradient, on
// the thread that runs backward, as soon as its reduction is launched; this
// class queues it for a worker thread of its own, which completes it (waits for
// the collective, sets .grad) and steps its parameters with the optimizer's own
// per-parameter update (on LibTorch's intra-op threads, without grad mode), so
// backward goes on meanwhile. On a GPU it queues that work on the stream
// backward handed the gradient over on (ReducedGrad::stream), not its own
// thread's default stream: under a user's CUDAStreamGuard the next forward
// waits for nothing else (test_cuda_streams' user's-stream tests). step() waits
// for the worker, then steps only what was not handed over; the root's next
// forward waits for it too, so no shard is read while it is written. The end
// of backward waits for the worker (after_backward): when backward returns,
// what it handed over is stepped and its .grad set, and the worker is idle
// until the next backward, so reading .grad, or changing an option, between
// backward and step() races with nothing. One step() per backward: a forward
// or a backward after a backward that handed parameters over, with no step()
// in between, is an error on every rank before any collective (accumulation
// belongs inside no_sync(), which hands over nothing); the backward waits for
// the worker first, so that not even its error path reads a shard being
// written. The phase (Phase) tells a backward that ended from one that threw
// midway, for the error's advice.
/// Where the threads stepping beside backward spent their time, summed over
/// every BackwardSteps of the process since the last take (per backward:
/// divide by the steps): bench_gpu_step reports it, to tell a host optimizer
/// that cannot keep up from one that waits for the GPU.
struct BackwardStepTimes {
  double span_ms = 0;       ///< from a backward's first hand-over to its last unit stepped
  double complete_ms = 0;   ///< waiting for reductions and whole copies (complete())
  double arrive_ms = 0;     ///< waiting for parts to land (GradPart::arrived())
  double step_ms = 0;       ///< stepping
  double step_wait_ms = 0;  ///< the end of backward waiting for all that (after_backward)
};

/// The times since the last call, then zero.
BackwardStepTimes take_backward_step_times();

/// One hand-over's path through the thread stepping beside backward, for a
/// profile of the step (bench_gpu_step --trace): when backward handed it
/// over, when its reduction (or whole copy) had completed, when its last
/// part had landed, when its last element was stepped.
struct BackwardStepEvent {
  std::chrono::steady_clock::time_point handed, completed, landed, stepped;
  int64_t elements = 0;  ///< the parameters' elements stepped
};

/// Starts (true) or stops recording a BackwardStepEvent per hand-over, for
/// every BackwardSteps of the process; off by default.
void record_backward_step_events(bool on);
/// The events recorded since the last call, in the order they were stepped.
std::vector<BackwardStepEvent> take_backward_step_events();

class BackwardSteps : public std::enable_shared_from_this<BackwardSteps> {
 public:
  /// Steps elements [begin, end) of one parameter from its .grad as the
  /// optimizer's step() does. Each parameter's ranges come in order from 0
  /// up and cover it once per step (Note [Stepping a gradient as it lands]);
  /// a range of all its elements is the whole step.
  using StepRange = std::function<void(at::Tensor& param, int64_t begin, int64_t end)>;

  /// `owner` names the optimizer's method in messages; `on_taken`, if set,
  /// runs in take_stepped() once the worker is idle.
  BackwardSteps(std::string owner, StepRange step_range, std::function<void()> on_taken = nullptr);
  /// Lets the worker finish its queue, then stops it.
  ~BackwardSteps();
  BackwardSteps(const BackwardSteps&) = delete;
  BackwardSteps& operator=(const BackwardSteps&) = delete;

  /// Installs the reduced-gradient hooks on `model`'s units.
  void attach(torch::nn::Module& model);
  /// Waits until every handed-over parameter is stepped; rethrows the first
  /// error the worker met.
  void wait();
  /// The root's forward begins: wait(), and refuse it while the last
  /// backward's steps were not taken by step() (an error on every rank).
  void before_forward();
  /// A backward begins: wait(), and refuse it while the last backward's
  /// steps were not taken by step() (an error on every rank).
  void before_backward();
  /// A backward ended: wait() (rethrowing the worker's error there).
  void after_backward();
  /// The optimizer attaches anew (step_during_backward() again): refused
  /// while the last backward's steps were not taken by step(), which would
  /// step them twice.
  void before_replaced();
  /// The model's state is read or written (a state dict, a checkpoint,
  /// SummonFullParams): wait(), and refuse it while the last backward's
  /// steps were not taken by step() (some shards stepped, the rest not).
  void before_state_use();
  /// The optimizer's state is saved or loaded (torch::save/load of it):
  /// the same refusal, in the optimizer's words.
  void before_optimizer_state_use();
  /// wait(), then the parameters stepped since the last call (forgotten).
  std::unordered_set<const c10::TensorImpl*> take_stepped();

 private:
  // Where the steps of one backward stand (under mutex_).
  enum class Phase {
    kIdle,        // nothing stepped since step() took the last
    kInBackward,  // a backward handed parameters over; its end not reached
    kEnded,       // it ended (after_backward); step() takes what it stepped
  };
  void set_phase(Phase next);  // checked transitions

  // A hand-over waiting for the worker, and when it came.
  struct Handed {
    ReducedGrad grad;
    std::chrono::steady_clock::time_point at;
  };

  void hand_over(ReducedGrad grad);
  // wait(), then the error, on every rank, if the last backward's steps were
  // not taken by step(); `pass` begins ("forward"), `cases` says when.
  void refuse_before_step(const char* pass, const char* cases);
  void run();
  void step(Handed& handed);

  const std::string owner_;
  const StepRange step_range_;
  const std::function<void()> on_taken_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Handed> queue_;
  bool busy_ = false;  // the worker is stepping a batch it took off queue_
  bool stopping_ = false;
  Phase phase_ = Phase::kIdle;
  std::exception_ptr error_;
  std::unordered_set<const c10::TensorImpl*> stepped_;
  // This backward's first hand-over and its last batch stepped, for
  // BackwardStepTimes::span_ms (under mutex_).
  std::chrono::steady_clock::time_point first_handed_{};
  std::chrono::steady_clock::time_point last_stepped_{};
  int attached_ = 0;  // attach() calls, counted in backward_steps_attached()
  std::thread worker_;
};

/// How many optimizers of this process step during backward (attached and
/// alive): a grad scaler refuses to scale a loss then, before any backward
/// steps on scaled gradients.
int backward_steps_attached();

}  // namespace fsdp::detail
