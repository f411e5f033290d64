#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/comm/types.h>
#include <fsdp/comm/work.h>

namespace fsdp::detail {

struct WorkState;

/// "4096 x Float": a collective's tensor in Work descriptions.
std::string describe_tensor(const at::Tensor& t);

/// Runs one group's collectives, in issue order, on a dedicated thread, so
/// that blocking engines (Gloo's calls, c10d's wait()) become asynchronous.
///
/// Note [Broken groups]
/// The first collective that fails (a peer died, a timeout) moves the group
/// from kHealthy to kBroken for good: the ranks no longer agree on what was
/// exchanged, so every later collective fails at once with the first cause
/// instead of pairing wrongly with a peer's next message or hanging.
///
/// Note [Running on the waiter]
/// A collective waited for right after it was issued (FSDP's unshard without
/// prefetch) would cost two thread hand-offs: waking the communication thread,
/// then waking the waiter. So Work::wait() runs the collective on the waiting
/// thread itself when it is next in the queue and no collective is running.
/// Order is kept (only the queue's front may run, one collective at a time);
/// asynchronous collectives still start at once on the communication thread.
class CommThread {
 public:
  /// `rank` and `timeout` are used in messages and as the wait limit.
  CommThread(int rank, std::chrono::milliseconds timeout);
  /// Finishes what is queued (each bounded by the timeout), then joins.
  ~CommThread();

  /// Queues `body` and returns its handle; `body` gets the collective's
  /// sequence number in this group (the same on every rank). `tensors` stay
  /// alive until it finished. The description names the collective in messages.
  Work enqueue(CollectiveKind kind, const std::string& what, std::vector<at::Tensor> tensors,
               std::function<void(uint64_t seq)> body);

  /// Runs `body` on the calling thread and returns a completed handle: for
  /// single-rank groups, where a hand-off would only add latency.
  Work run_inline(CollectiveKind kind, const std::string& what, std::vector<at::Tensor> tensors,
                  const std::function<void(uint64_t seq)>& body);

  /// Number of collectives issued so far (the next one's sequence number).
  uint64_t issued() const;

 private:
  struct Core;  // the queue and health, shared with pending Works
  std::shared_ptr<Core> core_;
  std::thread thread_;  // last: started after everything above exists
};

}  // namespace fsdp::detail
