// CUDA tensors' collectives over NCCL (label cuda; Note [NCCL collectives and
// their Work]): the same results as the CPU engine, the compute stream made
// to wait without the host, CPU tensors refused by name, and no memory kept
// from one collective to the next. One rank per GPU, or several on one GPU
// where NCCL is 2.30 or later with NCCL_MULTI_RANK_GPU_ENABLE=1; anywhere
// else each test is reported skipped, naming why.

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "comm/cuda_backend.h"
#include "comm/device_routed.h"
#include "comm_test_util.h"
#include "detail/torch_compat.h"
#include "device_routed_checks.h"
#include "multi_rank.h"
#include "settled_cuda_memory.h"

namespace fsdp::testing {
namespace test_nccl_cuda {

// Why NCCL cannot carry `world` ranks here ("" when it can).
std::string why_no_nccl(int world) {
  if (!at::hasCUDA()) return "no CUDA device visible";
  return detail::choose_cuda_backend(CudaBackend::kNccl, detail::this_process_cuda_facts(world))
      .why_not;
}

std::shared_ptr<ProcessGroup> join_nccl() {
  return init_process_group(
      ProcessGroupOptions().cuda_backend(CudaBackend::kNccl).timeout(std::chrono::seconds(60)));
}

at::Device my_gpu(int rank) { return at::Device(at::kCUDA, rank % at::getNumGPUs()); }

class NcclCuda : public ::testing::TestWithParam<int> {};

TEST_P(NcclCuda, CollectivesMatchTheCpuEngine) {
  const std::string why = why_no_nccl(GetParam());
  if (!why.empty()) GTEST_SKIP() << "NCCL cannot run here: " << why;
  run_ranks_ok(GetParam(), [](int rank, int) {
    auto pg = join_nccl();
    EXPECT_EQ(rank_info().cuda_backend, "nccl");
    expect_staged_matches_engine(*pg, detail::engine_of(*pg), my_gpu(rank), ExpectedRoute::kNccl);
  });
}

TEST_P(NcclCuda, TheComputeStreamWaitsNotTheHost) {
  const std::string why = why_no_nccl(GetParam());
  if (!why.empty()) GTEST_SKIP() << "NCCL cannot run here: " << why;
  run_ranks_ok(GetParam(), [](int rank, int world) {
    auto pg = join_nccl();
    const at::Device gpu = my_gpu(rank);
    const int64_t n = 1 << 20;
    for (int round = 0; round < 20; ++round) {
      // The input is written by a kernel just before; the all-gather's stream
      // must wait for it, and the reading kernels for the all-gather.
      at::Tensor mine = at::full({n}, static_cast<float>(rank + round), gpu);
      at::Tensor all = at::empty({world * n}, mine.options());
      Work w = pg->all_gather_into_tensor(all, mine);
      w.block_current_stream();
      const at::Tensor sums = all.view({world, n}).sum(1).cpu();
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(sums[r].item<float>(), static_cast<float>(n) * (r + round)) << "round " << round;
      }
      w.wait();
      EXPECT_TRUE(w.is_success());
    }
  });
}

TEST_P(NcclCuda, CpuTensorsAreRefusedByName) {
  const std::string why = why_no_nccl(GetParam());
  if (!why.empty()) GTEST_SKIP() << "NCCL cannot run here: " << why;
  run_ranks_ok(GetParam(), [](int, int) {
    auto pg = join_nccl();
    auto& nccl = *dynamic_cast<detail::DeviceRoutedProcessGroup&>(*pg).cuda_group();
    at::Tensor cpu = at::ones({4});
    try {
      nccl.all_reduce(cpu, ReduceOp::kSum);
      ADD_FAILURE() << "NCCL took a CPU tensor";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("NCCL carries CUDA tensors, got one on cpu"),
                std::string::npos)
          << e.what();
    }
    // The routed group sends CPU tensors to the CPU engine instead.
    pg->all_reduce(cpu, ReduceOp::kSum).wait();
    EXPECT_EQ(cpu[0].item<float>(), static_cast<float>(pg->size()));
  });
}

TEST_P(NcclCuda, MemoryIsTheSameAfterEveryRound) {
  const std::string why = why_no_nccl(GetParam());
  if (!why.empty()) GTEST_SKIP() << "NCCL cannot run here: " << why;
  run_ranks_ok(GetParam(), [](int rank, int world) {
    auto pg = join_nccl();
    const at::Device gpu = my_gpu(rank);
    const int64_t n = 1 << 18;
    int64_t after_first = -1;
    for (int round = 0; round < 10; ++round) {
      {
        // As the unit runtime waits: c10d's wait() releases its stash (Note
        // [NCCL collectives and their Work]).
        at::Tensor flat = at::full({world * n}, 1.0f, gpu);
        at::Tensor shard = at::empty({n}, flat.options());
        pg->reduce_scatter_tensor(shard, flat, ReduceOp::kAvg).block_current_stream();
        pg->all_gather_into_tensor(flat, shard).block_current_stream();
        EXPECT_EQ(flat.sum().item<float>(), static_cast<float>(world * n));
      }
      const int64_t now = settled_cuda_allocated(gpu.index());
      if (round == 1) after_first = now;
      if (round > 1) EXPECT_EQ(now, after_first) << "round " << round;
    }
  });
}

// A buffer freed while NCCL still reads or writes it on its own stream must
// not be handed to the caller's stream: the caller drops its handles right
// after issuing, then poisons every block it can get (NaN) while the
// collectives run; a result with a NaN, or a wrong one, means a block was
// reused too early.
TEST_P(NcclCuda, BuffersDroppedRightAfterIssueAreNotReusedEarly) {
  const std::string why = why_no_nccl(GetParam());
  if (!why.empty()) GTEST_SKIP() << "NCCL cannot run here: " << why;
  run_ranks_ok(GetParam(), [](int rank, int world) {
    auto pg = join_nccl();
    const at::Device gpu = my_gpu(rank);
    const int64_t n = 1 << 22;  // 16 MiB per rank: the collectives take a while
    for (int round = 0; round < 5; ++round) {
      at::Tensor shard = at::empty({n}, at::TensorOptions().device(gpu));
      Work reduced;
      {
        at::Tensor flat = at::full({world * n}, static_cast<float>(round + 1), gpu);
        reduced = pg->reduce_scatter_tensor(shard, flat, ReduceOp::kSum);
      }  // the input's last handle goes while NCCL reads it
      std::vector<at::Tensor> poison;
      for (int i = 0; i < 4; ++i) {
        poison.push_back(at::full({world * n}, std::nanf(""), gpu));
      }
      reduced.wait();
      EXPECT_EQ(shard.min().item<float>(), static_cast<float>(world * (round + 1)));
      EXPECT_EQ(shard.max().item<float>(), static_cast<float>(world * (round + 1)));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, NcclCuda, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Ranks";
                         });

}  // namespace test_nccl_cuda
}  // namespace fsdp::testing
