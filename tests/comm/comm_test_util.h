#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/comm/init.h>

#include <netinet/in.h>
#include <sys/socket.h>

#include "rendezvous/socket.h"

namespace fsdp::testing {

/// The collective engines this build has, for parameterised tests
/// (Backend::kC10dGloo needs Gloo's headers, absent from pip's torch wheel).
inline std::vector<Backend> available_engines() {
  std::vector<Backend> out;
  for (Backend b : {Backend::kGloo, Backend::kC10dGloo}) {
    if (backend_available(b)) out.push_back(b);
  }
  return out;
}

/// Joins the group that run_ranks' environment describes.
inline std::shared_ptr<ProcessGroup> join(
    Backend backend, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  return init_process_group(ProcessGroupOptions().backend(backend).timeout(timeout));
}

/// True when this kernel has an IPv6 loopback to bind (tests of ::1 skip otherwise).
inline bool have_ipv6_loopback() {
  detail::UniqueFd fd(::socket(AF_INET6, SOCK_STREAM, 0));
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  return fd.get() >= 0 && ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
}

/// Names a backend for parameterised test names.
inline std::string backend_label(const ::testing::TestParamInfo<Backend>& info) {
  return info.param == Backend::kGloo ? "Gloo" : "C10dGloo";
}

/// Expects `collective` to throw a c10::Error within `limit` (a dead or
/// stuck peer must fail it, not hang it); prints "got the expected error".
inline void expect_error_within(const std::function<void()>& collective,
                                std::chrono::steady_clock::duration limit) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    collective();
    ADD_FAILURE() << "the collective completed although its peers disagree or are gone";
  } catch (const c10::Error& e) {
    std::cout << "got the expected error: " << e.what() << std::endl;
  }
  EXPECT_LE(std::chrono::steady_clock::now() - t0, limit);
}

/// Bitwise equality with a message naming where the first difference is.
inline ::testing::AssertionResult tensors_equal(const at::Tensor& actual,
                                                const at::Tensor& expected) {
  if (actual.sizes() != expected.sizes() || actual.scalar_type() != expected.scalar_type()) {
    return ::testing::AssertionFailure()
           << "shape/dtype " << actual.sizes() << " " << actual.scalar_type() << " vs "
           << expected.sizes() << " " << expected.scalar_type();
  }
  if (at::equal(actual, expected)) return ::testing::AssertionSuccess();
  auto diff = (actual.to(at::kDouble) != expected.to(at::kDouble)).nonzero();
  const int64_t i = diff[0][0].item<int64_t>();
  return ::testing::AssertionFailure()
         << diff.size(0) << " of " << actual.numel() << " elements differ; first at " << i
         << ": got " << actual[i].item<double>() << ", expected " << expected[i].item<double>();
}

/// Issues an all-gather of `shard_numel`-element shards that the other ranks
/// issue with other sizes; expects, within 2 s (not a timeout), an error
/// saying the ranks issued different collectives, containing `names_sizes`,
/// naming what users' ranks differ in (torch::save outside SummonFullParams
/// on one rank) and not blaming a dead peer.
inline void expect_mismatched_all_gather_error(ProcessGroup& pg, int64_t shard_numel,
                                               const std::string& names_sizes) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    pg.all_gather_into_tensor(at::zeros({pg.size() * shard_numel}), at::ones({shard_numel})).wait();
    ADD_FAILURE() << "mismatched all-gathers completed";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    std::cout << "got the expected error: " << msg << std::endl;
    EXPECT_NE(msg.find("issued different collectives"), std::string::npos) << msg;
    EXPECT_NE(msg.find(names_sizes), std::string::npos) << msg;
    EXPECT_NE(msg.find("torch::save of a sharded model outside SummonFullParams"),
              std::string::npos)
        << msg;
    EXPECT_EQ(msg.find("probably died"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("difference).."), std::string::npos) << msg;
  }
  EXPECT_LE(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2))
      << "the mismatch waited for a timeout";
}

/// Alternates all-gathers and reduce-scatters of `shard_numel`-element shards
/// until one throws (a peer is gone), at most `rounds` pairs; prints "got the
/// expected error after N ms: ..." and returns how long the failing collective
/// took. A run where all succeed adds a gtest failure.
inline std::chrono::milliseconds collectives_until_error(ProcessGroup& pg, int64_t shard_numel,
                                                         int rounds) {
  at::Tensor flat = at::zeros({pg.size() * shard_numel});
  at::Tensor shard = at::ones({shard_numel});
  for (int i = 0; i < rounds; ++i) {
    const auto since = std::chrono::steady_clock::now();
    try {
      pg.all_gather_into_tensor(flat, shard).wait();
      pg.reduce_scatter_tensor(shard, flat).wait();
    } catch (const c10::Error& e) {
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - since);
      std::cout << "[rank " << pg.rank() << "] got the expected error after " << waited.count()
                << " ms: " << e.what() << std::endl;
      return waited;
    }
  }
  ADD_FAILURE() << rounds << " rounds of collectives succeeded although a peer is gone";
  return std::chrono::milliseconds(0);
}

/// What all_reduce(op) gives when rank r (of n) contributed
/// (arange(numel) % 7) + r + 1 (the tests' pattern), in closed form.
inline at::Tensor expected_all_reduce(int64_t numel, int n, ReduceOp op, at::ScalarType dtype) {
  const at::Tensor m = at::arange(numel, at::kLong).remainder(7);
  switch (op) {
    case ReduceOp::kSum:
      return (m * n + n * (n + 1) / 2).to(dtype);
    case ReduceOp::kAvg:
      return (m * n + n * (n + 1) / 2).to(dtype).div(n);
    case ReduceOp::kMax:
      return (m + n).to(dtype);
    case ReduceOp::kMin:
      return (m + 1).to(dtype);
  }
  return at::Tensor();
}

}  // namespace fsdp::testing
