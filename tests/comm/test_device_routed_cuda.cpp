// The device-routed group on a GPU (label cuda): CUDA tensors of ranks that
// share device 0, as the multi-rank GPU tests run, are staged through pinned
// host memory (Note [Tensors on other devices than the engine's]) and give
// the engine's results bitwise. Reported skipped, by name, without a GPU.

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <string>

#include "comm/device_routed.h"
#include "comm_test_util.h"
#include "device_routed_checks.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace test_device_routed_cuda {

class DeviceRoutedCuda : public ::testing::TestWithParam<int> {};

TEST_P(DeviceRoutedCuda, CudaTensorsAreStagedThroughTheHost) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible: nothing to stage";
  run_ranks_ok(GetParam(), [](int, int) {
    // Staged even where NCCL could run (test_nccl_cuda covers that route).
    auto pg = init_process_group(
        ProcessGroupOptions().cuda_backend(CudaBackend::kStaged).timeout(std::chrono::seconds(30)));
    expect_staged_matches_engine(*pg, detail::engine_of(*pg), at::Device(at::kCUDA, 0));
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, DeviceRoutedCuda, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Ranks";
                         });

}  // namespace test_device_routed_cuda
}  // namespace fsdp::testing
