#pragma once

// Checks of a device-routed group shared by test_device_routed (CPU tensors
// staged), test_device_routed_cuda (CUDA tensors staged), test_nccl_cuda
// (CUDA tensors over NCCL) and test_cuda_ipc (ranks sharing a GPU).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include <fsdp/comm/process_group.h>

#include "comm_test_util.h"

namespace fsdp::testing {

// Small integers, exact in every dtype used here; different on every rank.
inline at::Tensor rank_values(int64_t n, int rank, at::ScalarType dtype, at::Device device) {
  return (at::arange(n, at::kLong).remainder(7) + 10 * (rank + 1)).to(dtype).to(device);
}

// Which way a routed group's collectives are expected to go.
enum class ExpectedRoute { kStaged, kNccl, kCudaIpc };

// Runs every collective on `staged` and on `direct` (the engine) with the
// same inputs, on `device`, and expects the same results: bitwise, apart from
// NCCL's averages, which divide in their own order (to a dtype's rounding).
inline void expect_staged_matches_engine(ProcessGroup& staged, ProcessGroup& direct,
                                         at::Device device,
                                         ExpectedRoute route = ExpectedRoute::kStaged) {
  const int rank = direct.rank();
  const int world = direct.size();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(std::string("dtype ") + c10::toString(dtype));
    const int64_t n = 1000;  // per rank
    const at::Tensor mine = rank_values(n, rank, dtype, device);
    // All-gather, out of place and in place.
    at::Tensor got = at::zeros({world * n}, mine.options());
    Work w = staged.all_gather_into_tensor(got, mine);
    if (route == ExpectedRoute::kStaged) {
      EXPECT_EQ(w.describe().rfind("staged ", 0), 0u) << w.describe();
    } else {
      const char* tag = route == ExpectedRoute::kNccl ? ", nccl)" : ", cuda_ipc)";
      EXPECT_NE(w.describe().find(tag), std::string::npos) << w.describe();
    }
    w.wait();
    at::Tensor want = at::empty({world * n}, mine.options().device(at::kCPU));
    direct.all_gather_into_tensor(want, mine.cpu()).wait();
    EXPECT_TRUE(tensors_equal(got.cpu(), want));
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(tensors_equal(got.narrow(0, r * n, n).cpu(), rank_values(n, r, dtype, at::kCPU)));
    }
    at::Tensor in_place = at::zeros({world * n}, mine.options());
    in_place.narrow(0, rank * n, n).copy_(mine);
    staged.all_gather_into_tensor(in_place, in_place.narrow(0, rank * n, n)).wait();
    EXPECT_TRUE(tensors_equal(in_place.cpu(), want));
    // Reduce-scatter: sum and average; the input stays as it was.
    const at::Tensor flat = rank_values(world * n, rank, dtype, device);
    const at::Tensor flat_before = flat.clone();
    for (const auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      at::Tensor shard = at::zeros({n}, flat.options());
      staged.reduce_scatter_tensor(shard, flat, op).wait();
      at::Tensor expected = at::empty({n}, flat.options().device(at::kCPU));
      direct.reduce_scatter_tensor(expected, flat.cpu(), op).wait();
      if (route == ExpectedRoute::kNccl && op == ReduceOp::kAvg) {
        const double tol = dtype == at::kFloat ? 1e-6 : 1e-2;
        EXPECT_TRUE(at::allclose(shard.cpu().to(at::kFloat), expected.to(at::kFloat), tol, tol));
      } else {
        EXPECT_TRUE(tensors_equal(shard.cpu(), expected));
      }
    }
    EXPECT_TRUE(tensors_equal(flat.cpu(), flat_before.cpu()));
    // All-reduce and broadcast, in place.
    at::Tensor reduced = rank_values(n, rank, dtype, device);
    staged.all_reduce(reduced, ReduceOp::kMax).wait();
    EXPECT_TRUE(tensors_equal(reduced.cpu(), rank_values(n, world - 1, dtype, at::kCPU)));
    at::Tensor sent = rank_values(n, rank, dtype, device);
    staged.broadcast(sent, world - 1).wait();
    EXPECT_TRUE(tensors_equal(sent.cpu(), rank_values(n, world - 1, dtype, at::kCPU)));
  }
}

}  // namespace fsdp::testing
