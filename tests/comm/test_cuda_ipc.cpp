// Ranks sharing one GPU over CUDA IPC (CudaBackend::kCudaIpc, Note [Ranks
// sharing a GPU]; label cuda): every collective at 1-3 ranks gives the CPU
// engine's results bitwise, a collective issued right behind the kernel that
// writes its input (no synchronisation in between) sees that kernel's
// result, a 48 MiB all-reduce crosses several 32 MiB slots, and repeated
// collectives leave the caching allocator's count where it was. Reported
// skipped, by name, without a GPU.

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <string>

#if FSDP_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#endif

#include "comm/device_routed.h"
#include "comm_test_util.h"
#include "device_routed_checks.h"
#include "multi_rank.h"
#include "settled_cuda_memory.h"

namespace fsdp::testing {
namespace test_cuda_ipc {

class CudaIpc : public ::testing::TestWithParam<int> {};

std::shared_ptr<ProcessGroup> join_ipc() {
  return init_process_group(
      ProcessGroupOptions().cuda_backend(CudaBackend::kCudaIpc).timeout(std::chrono::seconds(60)));
}

TEST_P(CudaIpc, CollectivesGiveTheEnginesResults) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int) {
    auto pg = join_ipc();
    EXPECT_EQ(rank_info().cuda_backend, "cuda_ipc");
    expect_staged_matches_engine(*pg, detail::engine_of(*pg), at::Device(at::kCUDA, 0),
                                 ExpectedRoute::kCudaIpc);
  });
}

TEST_P(CudaIpc, StreamOrderManyRoundsAndNoGrowth) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int rank, int world) {
    auto pg = join_ipc();
    const at::Device gpu(at::kCUDA, 0);
    const int64_t n = 12 << 20;  // 48 MiB of fp32: two slots' worth and a half
    int64_t before = 0;
    for (int round = 0; round < 3; ++round) {
      if (round == 1) before = settled_cuda_allocated(0);
      // The input is written by kernels queued just before the collective,
      // behind a spin (about 10 ms), so they have not run when the
      // collective's stream would read it without waiting for them.
      at::Tensor t = at::full({n}, static_cast<float>(rank + 1), at::TensorOptions().device(gpu));
#if FSDP_WITH_CUDA
      at::cuda::sleep(20'000'000);
#endif
      t.mul_(2).add_(round);
      pg->all_reduce(t, ReduceOp::kSum).wait();
      const float want = static_cast<float>(world * (world + 1) + world * round);
      EXPECT_TRUE(at::equal(t, at::full({n}, want, t.options()))) << "round " << round;
    }
    EXPECT_EQ(settled_cuda_allocated(0), before) << "memory grew from round to round";
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, CudaIpc, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Ranks";
                         });

}  // namespace test_cuda_ipc
}  // namespace fsdp::testing
