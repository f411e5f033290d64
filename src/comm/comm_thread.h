#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
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

/// "all_gather #12 (4096 x Float)": a Work's description (`what` may be empty).
std::string describe_collective(CollectiveKind kind, uint64_t seq, const std::string& what);

/// Beyond the collective's own timeout, how long wait() gives the engine to
/// report it before declaring the collective lost.
constexpr auto kWaitGrace = std::chrono::seconds(5);

/// What every rank must agree on about one collective; exchanged before it
/// in debug mode (see Note [Collective fingerprints] in comm_thread.cpp).
struct Fingerprint {
  /// Number of int64 fields of a fingerprint on the wire.
  static constexpr int64_t kFields = 5;
  uint64_t seq = 0;                                ///< sequence number in the group
  CollectiveKind kind = CollectiveKind::kBarrier;  ///< the operation
  int64_t dtype = -1;                              ///< at::ScalarType, -1: no tensor
  int64_t numel = 0;                               ///< elements of the (flat) tensor
  int64_t detail = -1;                             ///< ReduceOp or broadcast root, -1: none

  /// The fingerprint as kFields int64 values.
  std::vector<int64_t> values() const;
  /// Reads one row written by values().
  static Fingerprint from_row(const int64_t* row);
  /// "all_reduce #5 (8 x Float, sum)", for messages.
  std::string to_string() const;
  /// True when every field is equal.
  bool operator==(const Fingerprint& other) const;
};

/// All-gathers every rank's fingerprint (`mine`, Fingerprint::kFields int64
/// values) for collective `seq` into a [size, kFields] tensor, over a channel
/// that cannot collide with the collectives themselves.
using FingerprintExchange = std::function<at::Tensor(const at::Tensor& mine, uint64_t seq)>;

/// Runs one group's collectives, in issue order, on a dedicated thread, so
/// that blocking engines (Gloo's calls, c10d's wait()) become asynchronous.
///
/// Note [Broken groups]
/// The first collective that fails (a peer died, a timeout) moves the group
/// from kHealthy to kBroken for good: the ranks no longer agree on what was
/// exchanged, so every later collective fails at once with the first cause
/// instead of pairing wrongly with a peer's next message or hanging. The
/// group then closes its links (set_on_broken), so that its neighbours fail
/// at once too, and theirs in turn, instead of each waiting out the timeout
/// for a message that will not come and blaming a live rank.
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
  /// `rank` and `timeout` are used in messages and as the wait limit. With
  /// `realtime` the thread asks for real-time priority (Note [Communication
  /// threads preempt compute]).
  CommThread(int rank, std::chrono::milliseconds timeout, bool realtime = false);
  /// Finishes what is queued (each bounded by the timeout), then joins.
  ~CommThread();

  /// Queues `body` and returns its handle; `body` gets the collective's
  /// sequence number in this group (the same on every rank). `tensors` stay
  /// alive until it finished; the first one (if any) is the one its
  /// fingerprint describes. The description names the collective in
  /// messages; `detail` is the ReduceOp or broadcast root (-1: none), for the
  /// fingerprint.
  Work enqueue(CollectiveKind kind, const std::string& what, std::vector<at::Tensor> tensors,
               int64_t detail, std::function<void(uint64_t seq)> body);

  /// Runs `body` on the calling thread and returns a completed handle: for
  /// single-rank groups, where a hand-off would only add latency (and where
  /// there is nothing to compare fingerprints with).
  Work run_inline(CollectiveKind kind, const std::string& what, std::vector<at::Tensor> tensors,
                  int64_t detail, const std::function<void(uint64_t seq)>& body);

  /// How the engine exchanges fingerprints; set once, before debug mode is
  /// switched on.
  void set_fingerprint_exchange(FingerprintExchange exchange);
  /// What the group does when it breaks (Note [Broken groups]), on the
  /// thread that ran the failed collective; set once, before any collective.
  void set_on_broken(std::function<void()> on_broken);
  /// Debug mode on or off for the collectives issued from now on (caller
  /// thread). See Note [Collective fingerprints].
  void set_debug(bool on);
  /// True when collectives issued now exchange fingerprints first.
  bool debug() const;

  /// Number of collectives issued so far (the next one's sequence number).
  uint64_t issued() const;

 private:
  struct Core;  // the queue and health, shared with pending Works
  std::shared_ptr<Core> core_;
  std::thread thread_;  // last: started after everything above exists
};

}  // namespace fsdp::detail
