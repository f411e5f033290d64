#include "comm/join_store.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <thread>

#include "detail/error.h"
#include "rendezvous/socket.h"
#include "rendezvous/tcp_store.h"

namespace fsdp::detail {

// Note [A store from an earlier init]
// A program may call init_process_group again after destroy_process_group
// (two trainings in one run, a test suite). Rank 0 then serves a new store
// on the same port, but a rank that finished the earlier group first can
// reach the port while rank 0's earlier store still listens, and would
// rendezvous there: it read rank 0's earlier link addresses and both sides
// waited until the timeout. So rank 0 marks its store once every rank has
// joined (kEveryRankJoined), and a rank that connects to a store so marked
// lets it go and connects again until rank 0's new one answers. Errors from
// a store never seen marked are the caller's as before (a wrong token, an
// unreachable host); after the mark they mean the earlier store went away.
c10::intrusive_ptr<c10d::Store> join_store(const std::string& host, int64_t port,
                                           const RankInfo& info, std::chrono::milliseconds timeout,
                                           const std::string& listen_addr,
                                           const std::string& job_token) {
  if (info.rank == 0) {
    return c10::make_intrusive<TcpStore>(host, static_cast<int>(port), true, timeout, listen_addr,
                                         job_token);
  }
  const auto deadline = deadline_after(timeout);
  bool saw_earlier = false;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    try {
      auto store = c10::make_intrusive<TcpStore>(host, static_cast<int>(port), false,
                                                 std::max(left, std::chrono::milliseconds(1)), "",
                                                 job_token);
      if (!store->check({kEveryRankJoined})) {
        // What was left of the timeout bounded the wait for rank 0's store;
        // each request from here on gets the whole timeout, as c10d's.
        store->setTimeout(timeout);
        return store;
      }
      saw_earlier = true;
    } catch (const c10::Error&) {
      if (!saw_earlier) throw;
    }
    FSDP_CHECK(std::chrono::steady_clock::now() < deadline, info.rank, "init_process_group",
               "the store at ", host, ":", port,
               " still serves an earlier process group whose ranks had all joined, and rank 0 "
               "started no new one within the timeout. Call destroy_process_group() on every "
               "rank before init_process_group() again, or give the new group another "
               "MASTER_PORT.");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace fsdp::detail
