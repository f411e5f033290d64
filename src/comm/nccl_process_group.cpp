// Built only with FSDP_WITH_NCCL (a CUDA build of LibTorch with NCCL's
// headers), with USE_C10D_NCCL defined for this file alone: it is the only
// one that sees c10d's ProcessGroupNCCL.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <set>
#include <thread>

#include "comm/comm_thread.h"
#include "comm/cuda_backend.h"
#include "comm/work_state.h"
#include "detail/error.h"

// Note [NCCL collectives and their Work]
// ProcessGroupNCCL enqueues each collective on its own stream, made to wait
// for the caller's current stream, and returns at once. A libfsdp Work over
// it must mean what every other Work means, so one thread per group
// (NcclCompletions) polls the collectives in issue order (a CUDA event query
// each, no host synchronisation of the streams) and finishes each Work once
// the GPU has: wait() then blocks the host until the result is in memory,
// continuations (chained hybrid reductions) run on that thread, and the
// tensors stay referenced until then. Work::block_current_stream() instead
// makes the caller's stream wait for the collective's end event (c10d's own
// wait() in its default, non-blocking mode), which is how the unit runtime
// waits for all-gathers: the host runs ahead of the GPU. A collective that
// fails is finished with NCCL's error named; one that outlives the group's
// timeout with a timeout error (c10d's watchdog, given the same timeout,
// aborts the communicator, so no rank hangs).
//
// c10d also keeps each collective's tensors (its stash) until its own wait():
// block_current_stream() calls it, so what the unit runtime waits for is
// released at once; a Work waited for on the host alone leaves them to c10d's
// watchdog, which hands them back at the group's next call, and a burst of
// such collectives holds its buffers that much longer (test_nccl_cuda).
// Calling c10d's wait() from the completion thread as each collective ends
// was tried on an H100: 2 of 4 processes then aborted at exit in SetDevice,
// none without it, so it is not done.

// Note [NCCL groups at exit]
// A group still alive when the process exits (the default group, which a
// static holds, or a user's global) was destroyed after the CUDA runtime had
// begun to unload: ProcessGroupNCCL::shutdown() then throws "driver shutting
// down" from a destructor, and every one-GPU-per-rank program ended in
// std::terminate after its last step (seen on an H100). Exit handlers run in
// the reverse order of their registration, and the runtime registers its own
// when it initialises, so a group registers one with std::atexit (the first
// group to do so, for all) that shuts down every group still alive, as
// destroy_process_group() would, and it does so at its first collective: its
// tensors are on a GPU then, so the runtime is up. Registering when the group
// was made was not enough: asking for the device count (choosing NCCL) does
// not always initialise the runtime, and a world-1 program made its group
// before touching a GPU; its handler then ran after the runtime's, and one
// run in three still aborted in SetDevice at exit (H100, 2026-11-27). A
// group's destructor then has nothing left to release. Should the runtime be
// gone anyway, the communicator is left to the process's end rather than
// torn down.

namespace fsdp::detail {

namespace {

std::exception_ptr named_error(int rank, const std::string& what) {
  try {
    FSDP_FAIL(rank, "process group", what);
  } catch (...) {
    return std::current_exception();
  }
}

std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.what_without_backtrace();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "an unknown error";
  }
}

// Finishes each group's Works in issue order as the GPU completes them.
class NcclCompletions {
 public:
  NcclCompletions(int rank, std::chrono::milliseconds timeout)
      : rank_(rank), timeout_(timeout), thread_([this] { run(); }) {}
  ~NcclCompletions() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  /// `gpu`: the collective's device, current on this thread while it polls.
  void add(c10::intrusive_ptr<c10d::Work> work, std::shared_ptr<WorkState> state,
           c10::DeviceIndex gpu) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_.push_back(
          {std::move(work), std::move(state), std::chrono::steady_clock::now() + timeout_, gpu});
    }
    wake_.notify_all();
  }

  /// A host waits for `state`'s Work: poll at the shortest interval until it
  /// has finished, so the waiter learns of its end within microseconds, not
  /// the 1 ms the polling otherwise backs off to while the GPU works (the
  /// optimizer's thread beside backward waits so for every unit's
  /// reduction).
  void hurry(const WorkState* state) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = std::find_if(pending_.begin(), pending_.end(),
                                   [state](const Pending& p) { return p.state.get() == state; });
      if (it == pending_.end()) return;  // finished already
      if (!it->hurried) ++hurried_;
      it->hurried = true;
      poll_ = kFirstPoll;
    }
    wake_.notify_all();
  }

 private:
  static constexpr std::chrono::microseconds kFirstPoll{20};

  struct Pending {
    c10::intrusive_ptr<c10d::Work> work;
    std::shared_ptr<WorkState> state;
    std::chrono::steady_clock::time_point deadline;
    c10::DeviceIndex gpu;
    bool hurried = false;  // a host waits for it (hurry())
  };

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      wake_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
      if (pending_.empty()) return;  // stopping, nothing left
      Pending& front = pending_.front();
      // The event query, and the tensors let go below, on the collective's
      // GPU: a thread that never set its device would make a context on
      // GPU 0 (hundreds of MB of another rank's GPU, where rank k is on k).
      if (front.gpu >= 0 && front.gpu != gpu_) {
        c10::cuda::set_device(front.gpu);
        gpu_ = front.gpu;
      }
      const bool done = front.work->isCompleted();
      const bool late = !done && std::chrono::steady_clock::now() > front.deadline;
      if (!done && !late) {
        // Back off from 20 us to 1 ms while the GPU works, unless a host
        // waits (hurry()).
        wake_.wait_for(lock, poll_);
        if (hurried_ == 0) poll_ = std::min(poll_ * 2, std::chrono::microseconds(1000));
        continue;
      }
      poll_ = kFirstPoll;
      if (front.hurried) --hurried_;
      Pending item = std::move(front);
      pending_.pop_front();
      lock.unlock();
      std::exception_ptr error;
      if (late) {
        error =
            named_error(rank_, item.state->description + " did not complete on the GPU within " +
                                   std::to_string(timeout_.count()) +
                                   " ms (NCCL). A peer rank has probably died, hangs, or "
                                   "issued a different collective; look at its output.");
      } else if (item.work->exception()) {
        error = named_error(rank_, item.state->description +
                                       " failed in NCCL: " + message_of(item.work->exception()));
      }
      item.state->finish(error);
      lock.lock();
    }
  }

  const int rank_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  std::chrono::microseconds poll_ = kFirstPoll;
  int hurried_ = 0;            // pending Works a host waits for
  c10::DeviceIndex gpu_ = -1;  // this thread's current device, once set
  bool stopping_ = false;
  std::thread thread_;  // last: started once the rest exists
};

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAvg:
      return c10d::ReduceOp::AVG;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    default:
      return c10d::ReduceOp::SUM;
  }
}

/// CUDA tensors' collectives over c10d's ProcessGroupNCCL (Note [NCCL
/// collectives and their Work]).
class NcclProcessGroup final : public ProcessGroup {
 public:
  NcclProcessGroup(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                   std::chrono::milliseconds timeout)
      : ProcessGroup(rank, size, timeout), store_(std::move(store)) {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    nccl_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(store_, rank, size, options);
    completions_ = std::make_shared<NcclCompletions>(rank, timeout);
  }
  ~NcclProcessGroup() override;

  /// Finishes every Work, then shuts the communicator down; once (the
  /// destructor or the exit handler, whichever comes first: Note [NCCL
  /// groups at exit]).
  void shut_down() {
    completions_.reset();  // every Work finished first
    if (!nccl_) return;
    try {
      nccl_->shutdown();
    } catch (const std::exception&) {
      (void)nccl_.release();  // the CUDA runtime is gone: nothing to release
      return;
    }
    nccl_.reset();
  }

  std::string backend_name() const override { return "nccl"; }

  Work all_gather_into_tensor(const at::Tensor& flat, const at::Tensor& shard) override {
    check_all_gather(flat, shard);
    check_cuda("all_gather", flat);
    at::Tensor out = flat.view(-1);
    at::Tensor in = shard.view(-1);
    return track(kAllGather, describe_tensor(flat), nccl_->_allgather_base(out, in), {flat, shard});
  }

  Work reduce_scatter_tensor(const at::Tensor& shard, const at::Tensor& flat,
                             ReduceOp op) override {
    check_reduce_scatter(shard, flat, op);
    check_cuda("reduce_scatter", flat);
    at::Tensor out = shard.view(-1);
    at::Tensor in = flat.view(-1);
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = to_c10d(op);
    return track(kReduceScatter, describe_tensor(flat) + ", " + to_string(op),
                 nccl_->_reduce_scatter_base(out, in, opts), {shard, flat});
  }

  Work all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    check_single("all_reduce", tensor);
    check_cuda("all_reduce", tensor);
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(op);
    return track(kAllReduce, describe_tensor(tensor) + ", " + to_string(op),
                 nccl_->allreduce(tensors, opts), {tensor});
  }

  Work broadcast(const at::Tensor& tensor, int root) override {
    check_single("broadcast", tensor);
    check_root(root);
    check_cuda("broadcast", tensor);
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    return track(kBroadcast, describe_tensor(tensor) + ", root " + std::to_string(root),
                 nccl_->broadcast(tensors, opts), {tensor});
  }

  // A one-element all-reduce on the GPU of this group's last collective (else
  // the current one): c10d's own barrier guesses a device from the rank.
  Work barrier() override {
    const int last = last_gpu_.load();
    const auto gpu = last >= 0 ? static_cast<c10::DeviceIndex>(last) : c10::cuda::current_device();
    at::Tensor one = at::zeros({1}, at::TensorOptions().device(at::kCUDA, gpu));
    std::vector<at::Tensor> tensors{one};
    return track(kBarrier, "", nccl_->allreduce(tensors), {one});
  }

  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks) override {
    check_subgroup_ranks(ranks);
    const std::string prefix = "nccl_sub" + std::to_string(subgroups_made_++);
    auto it = std::find(ranks.begin(), ranks.end(), rank());
    if (it == ranks.end()) return nullptr;
    return std::make_shared<NcclProcessGroup>(
        c10::make_intrusive<c10d::PrefixStore>(prefix, store_),
        static_cast<int>(it - ranks.begin()), static_cast<int>(ranks.size()), timeout());
  }

 private:
  static constexpr auto kAllGather = CollectiveKind::kAllGather;
  static constexpr auto kReduceScatter = CollectiveKind::kReduceScatter;
  static constexpr auto kAllReduce = CollectiveKind::kAllReduce;
  static constexpr auto kBroadcast = CollectiveKind::kBroadcast;
  static constexpr auto kBarrier = CollectiveKind::kBarrier;

  void register_live();  // defined below LiveGroups

  void check_cuda(const char* op, const at::Tensor& t) {
    FSDP_CHECK(t.is_cuda(), rank(), "process group", op, ": NCCL carries CUDA tensors, got one on ",
               t.device(),
               ". Collectives of CPU tensors go to the group init_process_group "
               "returned, which routes them to its CPU engine.");
    last_gpu_ = t.device().index();
  }

  Work track(CollectiveKind kind, const std::string& what, c10::intrusive_ptr<c10d::Work> work,
             std::vector<at::Tensor> tensors) {
    const auto gpu = static_cast<c10::DeviceIndex>(
        tensors.empty() ? last_gpu_.load() : tensors.front().device().index());
    auto state = std::make_shared<WorkState>(
        describe_collective(kind, seq_++, what.empty() ? "nccl" : what + ", nccl"), rank(),
        timeout() + kWaitGrace, std::move(tensors));
    state->stream_wait = [work] { work->wait(); };
    state->run_here = [weak =
                           std::weak_ptr<NcclCompletions>(completions_)](const WorkState* state) {
      if (auto completions = weak.lock()) completions->hurry(state);
      return false;  // the GPU runs it; the waiter only asks for an early look
    };
    completions_->add(std::move(work), state, gpu);
    // Once the runtime is surely up (Note [NCCL groups at exit]).
    std::call_once(registered_live_, [this] { register_live(); });
    return Work(state);
  }

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl_;  // null once shut down
  // Atomic: a hybrid chain issues its second collective from the thread
  // that finished the first (Note [NCCL collectives and their Work]).
  std::atomic<uint64_t> seq_{0};
  std::once_flag registered_live_;
  std::atomic<int> last_gpu_{-1};
  int subgroups_made_ = 0;  // caller thread only
  std::shared_ptr<NcclCompletions> completions_;
};

// The groups alive, for the exit handler (Note [NCCL groups at exit]).
class LiveGroups {
 public:
  // Made at the first collective of any group, when its exit handler is
  // registered; never destroyed: the handler may run after static destructors.
  static LiveGroups& get() {
    static auto* live = [] {
      auto* made = new LiveGroups();
      std::atexit(&LiveGroups::at_exit);
      made_.store(made);
      return made;
    }();
    return *live;
  }
  // The registry if a group registered, else nullptr (a group that never
  // issued a collective has nothing to unregister).
  static LiveGroups* if_made() { return made_.load(); }
  void add(NcclProcessGroup* group) {
    std::lock_guard<std::mutex> lock(mutex_);
    groups_.insert(group);
  }
  void remove(NcclProcessGroup* group) {
    std::lock_guard<std::mutex> lock(mutex_);
    groups_.erase(group);
  }

 private:
  static void at_exit() {
    LiveGroups& live = get();
    std::lock_guard<std::mutex> lock(live.mutex_);
    for (NcclProcessGroup* group : live.groups_) group->shut_down();
    live.groups_.clear();
  }

  static inline std::atomic<LiveGroups*> made_{nullptr};
  std::mutex mutex_;
  std::set<NcclProcessGroup*> groups_;
};

void NcclProcessGroup::register_live() { LiveGroups::get().add(this); }

NcclProcessGroup::~NcclProcessGroup() {
  if (LiveGroups* live = LiveGroups::if_made()) live->remove(this);
  shut_down();
}

}  // namespace

int built_nccl_version() { return c10d::getNcclVersionNumber(); }

std::shared_ptr<ProcessGroup> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int size,
                                              std::chrono::milliseconds timeout) {
  // One rank has nobody to meet: a store in memory.
  c10::intrusive_ptr<c10d::Store> base =
      store ? store : c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::HashStore>());
  return std::make_shared<NcclProcessGroup>(
      c10::make_intrusive<c10d::PrefixStore>("fsdp/nccl", base), rank, size, timeout);
}

}  // namespace fsdp::detail
