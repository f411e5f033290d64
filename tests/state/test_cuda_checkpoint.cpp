// Checkpoints of a model trained on a GPU (label cuda): full and sharded
// checkpoints written from GPU memory load into a fresh model on the GPU
// and into one on the CPU with the same parameters and AdamW state, at 1-3
// ranks. Reported skipped, by name, without a GPU.

#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include <fsdp/fsdp.h>

#include "state_test_util.h"

namespace fsdp::testing {
namespace test_cuda_checkpoint {

namespace nn = torch::nn;

using Wrapped = FullyShardedDataParallel<nn::SequentialImpl>;

Wrapped make_on(const torch::Device& device) {
  torch::manual_seed(0);
  nn::Sequential net(nn::Linear(7, 16), nn::GELU(), nn::LayerNorm(nn::LayerNormOptions({16})),
                     nn::Linear(16, 3));
  net->to(device);
  return Wrapped(net, FSDPOptions());
}

torch::OrderedDict<std::string, torch::Tensor> on_cpu(
    const torch::OrderedDict<std::string, torch::Tensor>& dict) {
  torch::OrderedDict<std::string, torch::Tensor> out;
  for (const auto& item : dict) out.insert(item.key(), item.value().cpu());
  return out;
}

class CudaCheckpoint : public ::testing::TestWithParam<int> {};

TEST_P(CudaCheckpoint, SavedFromGpuMemoryLoadsOnTheGpuAndOnTheCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  const std::string dir = test_dir();
  run_ranks_ok(
      GetParam(),
      [](int rank, int) {
        init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
        const std::string root = test_dir();
        const torch::Device gpu(torch::kCUDA, 0);
        Wrapped model = make_on(gpu);
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
        for (int s = 0; s < 2; ++s) {
          torch::manual_seed(100 + 10 * s + rank);
          const torch::Tensor x = torch::randn({4, 7}).to(gpu);
          opt.zero_grad();
          model->forward(x).pow(2).sum().backward();
          opt.step();
        }
        const auto params = on_cpu(full_state_dict(*model.ptr()));
        const auto state = on_cpu(full_optim_state_dict(*model.ptr(), opt));
        for (const auto type : {StateDictType::kFull, StateDictType::kSharded}) {
          const std::string what = to_string(type);
          const std::string path = root + "/" + what;
          Checkpointer(*model.ptr(), &opt).save(path, 2, type);
          for (const torch::Device device : {gpu, torch::Device(torch::kCPU)}) {
            Wrapped fresh = make_on(device);
            torch::optim::AdamW fresh_opt(fresh->parameters(), torch::optim::AdamWOptions(1e-2));
            EXPECT_EQ(Checkpointer(*fresh.ptr(), &fresh_opt).load(path), 2) << what;
            for (const auto& p : fresh->parameters()) EXPECT_EQ(p.device(), device) << what;
            expect_bitwise_equal(on_cpu(full_state_dict(*fresh.ptr())), params,
                                 what + " on " + device.str());
            expect_bitwise_equal(on_cpu(full_optim_state_dict(*fresh.ptr(), fresh_opt)), state,
                                 what + " optimizer on " + device.str());
          }
        }
      },
      with_dir(dir));
  remove_test_dir(dir);
}

INSTANTIATE_TEST_SUITE_P(Ranks, CudaCheckpoint, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Ranks";
                         });

}  // namespace test_cuda_checkpoint
}  // namespace fsdp::testing
