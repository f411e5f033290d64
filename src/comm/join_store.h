#pragma once

// How a rank reaches rank 0's rendezvous store at init_process_group.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

#include <fsdp/comm/init.h>

namespace fsdp::detail {

/// Rank 0 sets it once every rank has joined its store (Note [A store from an
/// earlier init]).
constexpr const char* kEveryRankJoined = "fsdp/init/every_rank_joined";

/// Rank 0 serves the store on `listen_addr`; another rank connects to
/// host:port, trying until `timeout` and passing over a store of an earlier
/// group. The store's requests then get the whole `timeout` each.
c10::intrusive_ptr<c10d::Store> join_store(const std::string& host, int64_t port,
                                           const RankInfo& info, std::chrono::milliseconds timeout,
                                           const std::string& listen_addr,
                                           const std::string& job_token);

}  // namespace fsdp::detail
