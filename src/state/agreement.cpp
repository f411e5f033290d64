#include "state/agreement.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <iostream>
#include <memory>
#include <mutex>
#include <thread>

#include <fsdp/error_message.h>
#include <fsdp/state/error.h>

#include "comm/agreement.h"
#include "core/device_streams.h"
#include "detail/error.h"

namespace fsdp::detail {

void agree(ProcessGroup* group, const std::exception_ptr& error, const std::string& dir,
           const std::string& phase, const std::string& consequence) {
  std::string failed;
  if (group != nullptr && group->size() > 1) {
    std::vector<int64_t> flags(group->size(), 0);
    if (error) flags[group->rank()] = 1;
    failed = ranks_with(agree_reduce(group, std::move(flags), ReduceOp::kSum), 1);
  }
  if (error) std::rethrow_exception(error);
  if (!failed.empty()) {
    throw CheckpointError(dir, "rank(s) " + failed + " failed while " + phase +
                                   " (see that rank's error); " + consequence);
  }
}

// Note [Waiting for a rank that writes more]
// A save's ranks do not write alike: under NO_SHARD rank 0 writes the whole
// model and optimizer, under HYBRID_SHARD only the first node writes, and a
// slow disk is slow for one rank. The others waited in the agreement that
// follows, a collective bounded by the group's timeout (5 minutes by
// default), and failed there while the writer was still writing ("a peer
// rank has probably died"): a large model could not be saved. So the work
// runs on a thread of its own, and this thread takes part in rounds of a
// one-element all-gather (each rank's "done") every quarter of the timeout
// until every rank is done: no collective waits longer than a round. Rank 0
// says every minute whom it waits for, and how long it has, so that a long
// save shows progress. The ranks run the same rounds: each round's result
// is the same on all, and decides the next.
void agree_after_work(ProcessGroup* group, const std::function<void()>& work,
                      const std::vector<c10::Stream>& streams, const std::string& dir,
                      const std::string& phase, const std::string& consequence) {
  std::exception_ptr error;
  if (group == nullptr || group->size() == 1) {
    try {
      work();
    } catch (...) {
      error = std::current_exception();
    }
    agree(group, error, dir, phase, consequence);
    return;
  }
  std::mutex mutex;
  std::condition_variable changed;
  bool done = false;
  std::thread worker([&] {
    try {
      std::vector<std::unique_ptr<OnStream>> on;
      for (const c10::Stream& s : streams) on.push_back(std::make_unique<OnStream>(s));
      work();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mutex);
    done = true;
    changed.notify_all();
  });
  const auto round = std::max(std::chrono::milliseconds(50), group->timeout() / 4);
  const auto start = std::chrono::steady_clock::now();
  auto next_note = start + std::chrono::minutes(1);
  // A round that fails (a peer died) ends the wait once the work has: the
  // work uses this frame, and a joinable thread must not be destroyed.
  struct JoinAtExit {
    std::thread& worker;
    ~JoinAtExit() {
      if (worker.joinable()) worker.join();
    }
  } join_at_exit{worker};
  for (;;) {
    bool mine;
    {
      std::unique_lock<std::mutex> lock(mutex);
      changed.wait_for(lock, round, [&] { return done; });
      mine = done;
    }
    const std::string waiting = ranks_with(agree_gather(group, {mine ? 1 : 0}), 0);
    if (waiting.empty()) break;
    const auto now = std::chrono::steady_clock::now();
    if (group->rank() == 0 && now >= next_note) {
      next_note = now + std::chrono::minutes(1);
      const auto s = std::chrono::duration_cast<std::chrono::seconds>(now - start).count();
      std::cerr << error_prefix(0, dir) << "still " << phase << " after " << s
                << " s: waiting for rank(s) " << waiting << std::endl;
    }
  }
  worker.join();
  agree(group, error, dir, phase, consequence);
}

std::string ranks_with(const std::vector<int64_t>& per_rank, int64_t value) {
  std::string out;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    if (per_rank[r] == value) out += (out.empty() ? "" : ", ") + std::to_string(r);
  }
  return out;
}

std::string cause_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const CheckpointError*>(&e))
    return c->file() + ": " + c->problem();
  return error_message(e);
}

}  // namespace fsdp::detail
