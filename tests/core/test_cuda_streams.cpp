// The copy-in stream against the compute stream (label cuda; Note [Copy-in
// on a stream of its own]): what breaks only on a GPU. Each unit's forward
// first keeps the compute stream busy (a spin kernel) and only then reads its
// weights, and so does its backward, so the host runs far ahead and a unit's
// memory is given up while the kernels that read it have not run yet. The
// copy-in stream must not write the next unit's parameters into that memory
// before they ran, nor read the shards before the optimizer's step: the
// model trains like plain LibTorch, output and parameters compared every
// step at 1-3 ranks, with and without forward prefetch and CPU offload; and
// with the copy-in stream's waits dropped (FSDP_FAULT_COPY_IN_NO_WAIT=1),
// or only its wait before held memory is handed back (=held), the same
// comparison fails, so it can. With the host's optimizer stepping each unit
// beside backward under offload, the gradients it steps are plain
// LibTorch's too, and without the step-copy stream's wait for the reduction
// (FSDP_FAULT_STEP_COPY_NO_WAIT=1) they are not; on a user's stream, its
// steps of units on the GPU are ordered before the next forward, and off it
// (FSDP_FAULT_STEP_OFF_STREAM=1) they are not. GPU memory does not grow
// from step to step, and a forward holds at most two units' gathered
// parameters. Reported skipped, by name, without a GPU.

#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#if FSDP_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "detail/torch_compat.h"
#include "multi_rank.h"
#include "rank_gpu.h"
#include "settled_cuda_memory.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_cuda_streams {

namespace nn = torch::nn;

constexpr int64_t kWidth = 1024;  // a unit's 4.2 MB of fp32 parameters
constexpr int kUnits = 6;
// About 10 ms of an H100's clock: long against the copies and the host.
constexpr int64_t kSpinCycles = 20'000'000;

void spin() {
#if FSDP_WITH_CUDA
  at::cuda::sleep(kSpinCycles);
#endif
}

// A linear layer whose kernels queue behind a spin, forward and backward.
struct SlowLinearImpl : nn::Module {
  SlowLinearImpl() { linear = register_module("linear", nn::Linear(kWidth, kWidth)); }
  torch::Tensor forward(torch::Tensor x) {
    spin();
    torch::Tensor y = linear->forward(x);
    if (y.requires_grad()) {
      // Runs before the gradient reaches linear's backward, which reads the
      // weights.
      y.register_hook([](const torch::Tensor& g) {
        spin();
        return g;
      });
    }
    return torch::tanh(y);
  }
  nn::Linear linear{nullptr};
};
TORCH_MODULE(SlowLinear);

// kUnits slow layers, each an FSDP unit of its own when `wrap` is set.
struct StackImpl : nn::Module {
  StackImpl(const std::vector<SlowLinear>& plain, const FSDPOptions* wrap) {
    for (size_t i = 0; i < plain.size(); ++i) {
      layers.push_back(wrap == nullptr ? nn::AnyModule(plain[i])
                                       : nn::AnyModule(FullyShardedDataParallel<SlowLinearImpl>(
                                             plain[i].ptr(), *wrap)));
      register_module("l" + std::to_string(i), layers.back().ptr());
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) x = layer.forward(x);
    return x;
  }
  std::vector<nn::AnyModule> layers;
};
TORCH_MODULE(Stack);

std::vector<SlowLinear> seeded_layers(const torch::Device& device) {
  torch::manual_seed(0);
  std::vector<SlowLinear> layers;
  for (int i = 0; i < kUnits; ++i) {
    layers.emplace_back();
    layers.back()->to(device);
  }
  return layers;
}

struct Config {
  std::string name;
  bool forward_prefetch;
  BackwardPrefetch backward_prefetch;
  bool offload;
  // The host's FusedSGD steps each unit beside backward (step_during_backward),
  // its gradient copied to host memory whole or, with part_elements, in
  // parts of that many elements (Note [Copies queued at the hand-over]).
  bool beside_backward = false;
  int64_t part_elements = 0;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
};

std::vector<Config> configs() {
  return {{"own gathers", false, BackwardPrefetch::kNone, false},
          {"prefetch", true, BackwardPrefetch::kBackwardPre, false},
          {"offload", false, BackwardPrefetch::kBackwardPre, true},
          {"offload beside backward", false, BackwardPrefetch::kBackwardPre, true, true},
          {"offload beside backward, in parts", false, BackwardPrefetch::kBackwardPre, true, true,
           kWidth * kWidth / 4},
          {"offload beside backward, NO_SHARD (all-reduced)", false, BackwardPrefetch::kBackwardPre,
           true, true, 0, ShardingStrategy::kNoShard}};
}

// The largest differences to plain LibTorch: outputs and parameters
// (absolute), and with a config stepping beside backward the gradients the
// host stepped (relative to the largest of each, as they are small).
struct Worst {
  double values = 0;
  double grads = 0;
};

// The largest differences to plain LibTorch seen in `steps` steps of SGD on
// the ranks' different batches (the reference on their concatenation): the
// outputs of this rank's block, then every parameter (and its gradient)
// after the step. With `memory`, also checks that GPU memory does not grow
// from step to step.
Worst train_and_compare(const Config& config, int steps, bool memory) {
  const int world = rank_and_world().second;
  const torch::Device gpu = rank_gpu();
  Stack reference(seeded_layers(gpu), nullptr);
  FSDPOptions options = FSDPOptions()
                            .sharding_strategy(config.strategy)
                            .forward_prefetch(config.forward_prefetch)
                            .backward_prefetch(config.backward_prefetch);
  if (config.offload) options.cpu_offload(CPUOffload().offload_params(true));
  FullyShardedDataParallel<StackImpl> model(Stack(seeded_layers(gpu), &options).ptr(), options);
  const auto sgd = torch::optim::SGDOptions(0.05);
  torch::optim::SGD ref_opt(reference->parameters(), sgd);
  std::unique_ptr<torch::optim::SGD> owned_opt;
  if (config.beside_backward) {
    auto fused = std::make_unique<optim::FusedSGD>(model->parameters(), sgd);
    fused->step_during_backward(*model.ptr());
    owned_opt = std::move(fused);
  } else {
    owned_opt = std::make_unique<torch::optim::SGD>(model->parameters(), sgd);
  }
  torch::optim::SGD& opt = *owned_opt;
  if (config.part_elements > 0) {
    setenv("FSDP_GRAD_PART_ELEMENTS", std::to_string(config.part_elements).c_str(), 1);
  }
  // What a step may leave allocated: the gradients (the reference's and the
  // shards'), and the step's batch and outputs. Measured from a baseline
  // taken after one untimed reference step, which makes the cuBLAS
  // workspaces (kept, per thread and stream) of forward and backward.
  int64_t grad_bytes = 0;
  for (const auto& p : reference->parameters()) grad_bytes += p.numel() * p.element_size();
  for (const auto& p : model->parameters()) {
    if (p.is_cuda()) grad_bytes += p.numel() * p.element_size();
  }
  {
    const torch::Tensor warm = torch::randn({4 * world, kWidth}).to(gpu);
    reference->forward(warm).pow(2).mean().backward();
    ref_opt.zero_grad();
    for (auto& p : reference->parameters()) p.mutable_grad().reset();
  }
  const int64_t baseline = settled_cuda_allocated(rank_gpu_index());
  Worst worst;
  const auto compare = [](double& most, const torch::Tensor& a, const torch::Tensor& b,
                          bool relative) {
    const torch::Tensor want = b.to(torch::kCPU);
    double d = (a.to(torch::kCPU) - want).abs().max().item<double>();
    if (relative) d /= want.abs().max().item<double>() + 1e-30;
    most = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(most, d);
  };
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(100 + step);
    const torch::Tensor global = torch::randn({4 * world, kWidth}).to(gpu);
    ref_opt.zero_grad();
    const torch::Tensor ref_out = reference->forward(global);
    ref_out.pow(2).mean().backward();
    ref_opt.step();
    const int64_t before = settled_cuda_allocated(rank_gpu_index());
    opt.zero_grad();
    const torch::Tensor out = model->forward(local_block(global));
    out.pow(2).mean().backward();
    opt.step();
    // The output is still held here (compared below); the one of the step
    // before was freed before `before`.
    const int64_t after =
        settled_cuda_allocated(rank_gpu_index()) - static_cast<int64_t>(out.nbytes());
    // Step 0 makes the gradients that every later step reuses. Nothing a
    // unit gathered outlives the step (held memory is released at the end
    // of backward, not at the next forward): a unit is 4.2 MB.
    if (memory && step > 0) EXPECT_LE(after, before) << config.name << " step " << step;
    if (memory) {
      EXPECT_LE(after - baseline, grad_bytes + (1 << 20)) << config.name << " step " << step;
    }
    compare(worst.values, out, local_block(ref_out), false);
    SummonFullParams full(*model.ptr(), SummonOptions().with_grads(config.beside_backward));
    const auto expected = reference->named_parameters();
    for (const auto& p : model->named_parameters()) {
      compare(worst.values, p.value(), expected[p.key()], false);
      if (config.beside_backward) {
        compare(worst.grads, p.value().grad(), expected[p.key()].grad(), true);
      }
    }
  }
  unsetenv("FSDP_GRAD_PART_ELEMENTS");
  return worst;
}

class CudaStreams : public ::testing::TestWithParam<int> {};

TEST_P(CudaStreams, CopyInWaitsForTheKernelsThatReadItsMemory) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    for (const Config& config : configs()) {
      // Different batch sizes sum in another order: within fp32 rounding.
      const Worst worst = train_and_compare(config, 3, /*memory=*/true);
      EXPECT_LT(worst.values, 1e-4) << config.name;
      EXPECT_LT(worst.grads, 1e-3) << config.name;
    }
  });
}

TEST_P(CudaStreams, AForwardHoldsAtMostTwoUnitsGathered) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int world) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    const torch::Device gpu = rank_gpu();
    const int64_t padded = (kWidth * kWidth + kWidth + world - 1) / world * world;
    const int64_t unit_bytes = padded * 4;
    for (const bool prefetch : {false, true}) {
      const FSDPOptions options = FSDPOptions().forward_prefetch(prefetch);
      FullyShardedDataParallel<StackImpl> model(Stack(seeded_layers(gpu), &options).ptr(), options);
      const torch::Tensor x = torch::randn({4, kWidth}).to(gpu);
      torch::NoGradGuard no_grad;
      // The first matmul on this thread and stream takes cuBLAS's workspace,
      // which it keeps: not a unit's.
      model->forward(x);
      for (int pass = 0; pass < 3; ++pass) {
        const int64_t before = settled_cuda_allocated(rank_gpu_index());
        compat::reset_cuda_peak(rank_gpu_index());
        model->forward(x);
        const int64_t peak = compat::cuda_memory(rank_gpu_index()).peak_allocated - before;
        EXPECT_GE(peak, unit_bytes) << "prefetch " << prefetch << " pass " << pass;
        EXPECT_LE(peak, 2 * unit_bytes + (1 << 20)) << "prefetch " << prefetch << " pass " << pass;
        EXPECT_LE(settled_cuda_allocated(rank_gpu_index()), before)
            << "prefetch " << prefetch << " pass " << pass;
      }
    }
  });
}

// Training as above at 1 rank with FSDP_FAULT_COPY_IN_NO_WAIT=`fault`: the
// comparison with plain LibTorch must fail.
void expect_comparison_fails_under(const char* fault) {
  run_ranks_ok(1, [fault](int, int) {
    setenv("FSDP_FAULT_COPY_IN_NO_WAIT", fault, 1);
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    EXPECT_GT(train_and_compare(configs()[0], 3, /*memory=*/false).values, 1e-2) << fault;
  });
}

// The test above fails where the copy-in stream does not wait: its memory is
// then overwritten while the spinning compute stream has yet to read it.
TEST(CudaStreamsFault, WithoutTheWaitsTheComparisonFails) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  expect_comparison_fails_under("1");
}

// The same with only the wait before held memory is handed back dropped:
// the copy-in stream then gathers a unit into the memory of one whose
// kernels have not run yet (the others' waits cannot make up for it).
TEST(CudaStreamsFault, WithoutTheHeldMemoryWaitTheComparisonFails) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  expect_comparison_fails_under("held");
}

// Stepping beside backward at 1 rank (NCCL: its copies to host memory
// queued at the hand-over, behind the reduction) with
// FSDP_FAULT_STEP_COPY_NO_WAIT=1, which drops the step-copy stream's wait for
// the reduction: the spinning backward has not reduced yet when the copies
// run, so the host steps other gradients than plain LibTorch's, which the
// comparison must catch, whole and in parts.
TEST(CudaStreamsFault, WithoutTheStepCopyWaitTheGradientsDiffer) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(1, [](int, int) {
    setenv("FSDP_FAULT_STEP_COPY_NO_WAIT", "1", 1);
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    for (const Config& config : configs()) {
      if (!config.beside_backward) continue;
      EXPECT_GT(train_and_compare(config, 3, /*memory=*/false).grads, 0.1) << config.name;
    }
  });
}

// A user's stream: training under a CUDAStreamGuard of a stream from
// LibTorch's pool, which does not wait for the legacy default stream, with
// the units on the GPU stepped beside backward by the optimizer's thread
// (FusedSGD's LibTorch path). That thread must queue each step on the
// stream backward ran on: the default stream, kept busy meanwhile (a spin
// queued there before backward, as another library's work would be), must
// not hold the steps back while the next forward reads the shards. Returns
// the largest difference of this rank's outputs to plain LibTorch's, each
// step, relative to the largest output. `wrapped_first`: the models are
// made and wrapped on the default stream, and only training runs under the
// guard (Note [The stream of a gradient's hook]).
double users_stream_worst(int steps, bool wrapped_first = false) {
#if FSDP_WITH_CUDA
  const int world = rank_and_world().second;
  const torch::Device gpu = rank_gpu();
  std::optional<c10::cuda::CUDAStreamGuard> on_users;
  if (!wrapped_first) on_users.emplace(c10::cuda::getStreamFromPool());
  const auto seeded = [&] {
    torch::manual_seed(0);
    nn::Sequential net(nn::Linear(kWidth, kWidth), nn::Tanh(), nn::Linear(kWidth, kWidth));
    net->to(gpu);
    return net;
  };
  nn::Sequential reference = seeded();
  nn::Sequential model = seeded();
  fully_shard(*model->ptr(0));  // handed over as its reduction starts
  const std::vector<at::Tensor> params = fully_shard(*model).flat_parameters();  // at the end
  if (wrapped_first) {
    c10::cuda::getDefaultCUDAStream().synchronize();  // the weights are on the GPU
    on_users.emplace(c10::cuda::getStreamFromPool());
  }
  // Large steps, so that a forward reading a shard before its step is far off.
  const auto sgd = torch::optim::SGDOptions(0.1);
  torch::optim::SGD ref_opt(reference->parameters(), sgd);
  optim::FusedSGD opt(params, sgd);
  opt.step_during_backward(*model);
  double worst = 0;
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(100 + step);
    const torch::Tensor global = torch::randn({4 * world, kWidth}).to(gpu);
    ref_opt.zero_grad();
    const torch::Tensor ref_out = reference->forward(global);
    // The ranks' gradients are averaged: the sum over the global batch / (4 world).
    (ref_out.sum() / (4 * world)).backward();
    ref_opt.step();
    opt.zero_grad();
    const torch::Tensor out = model->forward(local_block(global));
    {
      const c10::cuda::CUDAStreamGuard on_default(c10::cuda::getDefaultCUDAStream());
      at::cuda::sleep(10 * kSpinCycles);
    }
    (out.sum() / 4).backward();
    opt.step();
    const torch::Tensor want = local_block(ref_out).to(torch::kCPU);
    const double d =
        (out.to(torch::kCPU) - want).abs().max().item<double>() / want.abs().max().item<double>();
    worst = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(worst, d);
  }
  c10::cuda::getDefaultCUDAStream().synchronize();
  return worst;
#else
  (void)steps;
  (void)wrapped_first;
  return 0;
#endif
}

TEST_P(CudaStreams, StepsBesideBackwardOnTheUsersStream) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    EXPECT_LT(users_stream_worst(3), 1e-4);
  });
}

// The same with the model wrapped before the guard, as a user who sets up
// first and trains under a stream of their own does: the gradients' hooks,
// which autograd runs on the stream current at wrapping (the default one,
// spinning here), must still queue the reductions and steps on the
// training's stream.
TEST_P(CudaStreams, StepsBesideBackwardOnTheUsersStreamEnteredAfterWrapping) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    EXPECT_LT(users_stream_worst(3, /*wrapped_first=*/true), 1e-4);
  });
}

// The test above with FSDP_FAULT_STEP_OFF_STREAM=1, which leaves the
// optimizer's thread on its own (the default) stream: the steps queue behind
// the spin there, the next forward reads the shards before them, and the
// outputs differ from plain LibTorch's.
TEST(CudaStreamsFault, StepsOffTheUsersStreamAreReadBeforeTheyRun) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(1, [](int, int) {
    setenv("FSDP_FAULT_STEP_OFF_STREAM", "1", 1);
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    EXPECT_GT(users_stream_worst(3), 1e-2);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, CudaStreams, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Ranks";
                         });

}  // namespace test_cuda_streams
}  // namespace fsdp::testing
