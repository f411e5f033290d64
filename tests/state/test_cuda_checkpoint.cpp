// Checkpoints of a model trained on a GPU (label cuda): full and sharded
// checkpoints written from GPU memory load into a fresh model on the GPU
// and into one on the CPU with the same parameters and AdamW state, at 1-3
// ranks; and the full values gathered into host memory one unit at a time
// (offload_to_cpu); resume restores the GPU's generator. Reported skipped,
// by name, without a GPU.

#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include <fsdp/fsdp.h>

#include "rank_gpu.h"
#include "settled_cuda_memory.h"
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

class CudaCheckpoint : public ::testing::TestWithParam<int> {
 protected:
  // Runs `body(rank, gpu)` on GetParam() ranks, each on its rank_gpu() (GPU 0
  // for all where there is one) and joined to the job, with a test directory of its own.
  void on_gpu_ranks(const std::function<void(int rank, const torch::Device& gpu)>& body) {
    const std::string dir = test_dir();
    run_ranks_ok(
        GetParam(),
        [&body](int rank, int) {
          init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
          body(rank, rank_gpu());
        },
        with_dir(dir));
    remove_test_dir(dir);
  }
};

TEST_P(CudaCheckpoint, SavedFromGpuMemoryLoadsOnTheGpuAndOnTheCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  on_gpu_ranks([](int rank, const torch::Device& gpu) {
    const std::string root = test_dir();
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
  });
}

constexpr int64_t kWidth = 512, kUnits = 6;  // six units of 1 MiB

// SummonOptions::offload_to_cpu and StateDictOptions::offload_to_cpu (FSDP1's
// names), with rank0_only: each unit's full values leave the GPU as soon as
// they are gathered, so the caching allocator's peak grows by a unit's full
// parameters or two (at most 3 of the 6), not the model's (as it does
// without offload), in float32 and under bf16 mixed precision (whose
// summoned values are the float32 ones), gradients too (with_grads); rank
// 0's torch::save inside the guard writes a file the plain model on the CPU
// loads.
TEST_P(CudaCheckpoint, OffloadToCpuHoldsOneUnitAtATimeOnTheGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  on_gpu_ranks([](int rank, const torch::Device& gpu) {
    const int64_t unit_bytes = (kWidth * kWidth + kWidth) * 4;
    auto make_net = [] {
      torch::manual_seed(0);
      nn::Sequential net;
      for (int64_t i = 0; i < kUnits; ++i) net->push_back(nn::Linear(kWidth, kWidth));
      return net;
    };
    for (bool mixed : {false, true}) {
      const std::string what = mixed ? "bf16" : "fp32";
      FSDPOptions options;
      if (mixed) options.mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16));
      nn::Sequential net = make_net();
      net->to(gpu);
      auto_wrap(net, module_type_policy<nn::LinearImpl>(), options);
      Wrapped model(net, options);
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::manual_seed(100 + rank);
      model->forward(torch::randn({4, kWidth}).to(gpu)).pow(2).sum().backward();
      opt.step();
      // Growth of the peak over what is in use before `f`.
      auto peak_growth = [&](const std::function<void()>& f) {
        const int64_t before = settled_cuda_allocated(rank_gpu_index());
        compat::reset_cuda_peak(rank_gpu_index());
        f();
        return compat::cuda_memory(rank_gpu_index()).peak_allocated - before;
      };
      torch::OrderedDict<std::string, torch::Tensor> dict;
      const int64_t dict_growth = peak_growth([&] {
        dict =
            full_state_dict(*model.ptr(), StateDictOptions().offload_to_cpu(true).rank0_only(true));
      });
      EXPECT_LE(dict_growth, 3 * unit_bytes) << what;
      EXPECT_EQ(dict.size(), rank == 0 ? static_cast<size_t>(2 * kUnits) : 0u) << what;
      for (const auto& item : dict) {
        EXPECT_EQ(item.value().device(), torch::Device(torch::kCPU)) << what << item.key();
      }
      const std::string path = test_dir() + "/offloaded_" + what + ".pt";
      const int64_t summon_growth = peak_growth([&] {
        SummonFullParams full(
            *model.ptr(), SummonOptions().offload_to_cpu(true).rank0_only(true).with_grads(true));
        if (rank != 0) return;
        for (const auto& p : model->named_parameters()) {
          EXPECT_EQ(p.value().device(), torch::Device(torch::kCPU)) << what << p.key();
          EXPECT_TRUE(p.value().grad().defined() && p.value().grad().is_cpu()) << what << p.key();
          EXPECT_EQ(p.value().scalar_type(), torch::kFloat) << what << p.key();
          EXPECT_TRUE(torch::equal(p.value(), dict[p.key()])) << what << p.key();
        }
        torch::save(model, path);
      });
      EXPECT_LE(summon_growth, 3 * unit_bytes) << what;
      // Without offload every unit is gathered on the GPU at once.
      const int64_t on_gpu_growth = peak_growth([&] { SummonFullParams full(*model.ptr()); });
      EXPECT_GE(on_gpu_growth, kUnits * unit_bytes) << what;
      // Training goes on on the GPU after the guards.
      model->forward(torch::randn({4, kWidth}).to(gpu)).pow(2).sum().backward();
      opt.step();
      for (const auto& p : model->parameters()) EXPECT_EQ(p.device(), gpu) << what;
      if (rank != 0) continue;
      nn::Sequential plain = make_net();
      torch::load(plain, path);
      for (const auto& p : plain->named_parameters()) {
        EXPECT_TRUE(torch::equal(p.value(), dict[p.key()])) << what << p.key();
      }
    }
  });
}

// Dropout on a GPU draws from that GPU's generator: a resumed run draws
// what the saved one would have drawn next on it (and on the CPU).
TEST_P(CudaCheckpoint, ResumeRestoresTheGpuGenerator) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  on_gpu_ranks([](int rank, const torch::Device& gpu) {
    const std::string path = test_dir() + "/rng";
    Wrapped model = make_on(gpu);
    torch::manual_seed(40 + rank);
    Checkpointer(*model.ptr()).save(path, 1);
    const torch::Tensor next = torch::rand({64}, torch::TensorOptions().device(gpu));
    const torch::Tensor dropped =
        torch::dropout(torch::ones({64}, torch::TensorOptions().device(gpu)), 0.5, true);
    torch::manual_seed(7);
    EXPECT_EQ(Checkpointer(*model.ptr()).load(path), 1);
    EXPECT_TRUE(torch::equal(torch::rand({64}, torch::TensorOptions().device(gpu)), next));
    EXPECT_TRUE(torch::equal(
        torch::dropout(torch::ones({64}, torch::TensorOptions().device(gpu)), 0.5, true), dropped));
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, CudaCheckpoint, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Ranks";
                         });

}  // namespace test_cuda_checkpoint
}  // namespace fsdp::testing
