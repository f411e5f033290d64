// The group init_process_group returns routes collectives by the tensors'
// device (Note [Tensors on other devices than the engine's]): CPU tensors go
// to the engine untouched, others are staged through host memory. The
// staging is device-neutral, so it is checked here on CPU tensors staged
// through buffers of their own, against the engine's results, at 1-3 ranks;
// test_device_routed_cuda (label cuda) runs it on a GPU.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "comm/device_routed.h"
#include "comm/gloo_process_group.h"
#include "comm_test_util.h"
#include "device_routed_checks.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace test_device_routed {

using detail::DeviceRoutedProcessGroup;

class DeviceRouted : public ::testing::TestWithParam<int> {};

TEST_P(DeviceRouted, StagedCollectivesMatchTheEngineBitwise) {
  run_ranks_ok(GetParam(), [](int, int) {
    auto pg = join(Backend::kGloo);
    DeviceRoutedProcessGroup staged(pg, /*stage_cpu_tensors=*/true);
    expect_staged_matches_engine(staged, *pg, at::kCPU);
    // Subgroups stage too.
    auto sub = staged.new_subgroup({0});
    if (pg->rank() == 0) {
      ASSERT_NE(sub, nullptr);
      at::Tensor t = at::ones({3});
      Work w = sub->all_reduce(t, ReduceOp::kSum);
      EXPECT_EQ(w.describe().rfind("staged ", 0), 0u) << w.describe();
      w.wait();
      EXPECT_TRUE(tensors_equal(t, at::ones({3})));
    } else {
      EXPECT_EQ(sub, nullptr);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, DeviceRouted, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Ranks";
                         });

TEST(DeviceRoutedGroup, CpuTensorsGoToTheEngineUntouched) {
  run_ranks_ok(2, [](int, int) {
    auto pg = join(Backend::kGloo);
    EXPECT_NE(dynamic_cast<DeviceRoutedProcessGroup*>(pg.get()), nullptr);
    EXPECT_NE(dynamic_cast<detail::GlooProcessGroup*>(&detail::engine_of(*pg)), nullptr);
    at::Tensor t = at::ones({4});
    Work w = pg->all_reduce(t, ReduceOp::kSum);
    EXPECT_EQ(w.describe().find("staged"), std::string::npos) << w.describe();
    w.wait();
    EXPECT_TRUE(tensors_equal(t, at::full({4}, 2.0f)));
  });
}

TEST(DeviceRoutedGroup, TensorsOnTwoDevicesAreAnError) {
  run_ranks_ok(1, [](int, int) {
    auto pg = join(Backend::kGloo);
    const at::Tensor flat = at::zeros({4});
    const at::Tensor shard = at::empty({4}, at::TensorOptions().device(at::kMeta));
    try {
      pg->all_gather_into_tensor(flat, shard);
      ADD_FAILURE() << "an all-gather across two devices was issued";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("different devices, cpu and meta"), std::string::npos) << msg;
    }
  });
}

}  // namespace test_device_routed
}  // namespace fsdp::testing
