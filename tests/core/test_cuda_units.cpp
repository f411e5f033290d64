// Units on a CUDA device (label cuda): a model moved to the rank's GPU
// (rank_gpu(): GPU 0 where there is one) and wrapped trains like plain
// LibTorch on the same GPU, trained on the concatenation of the ranks'
// different batches, compared every step, at 1-3 ranks sharing the GPU (one
// rank's collectives over NCCL, several ranks' over CUDA IPC where NCCL
// refuses them, or staged through the host under test_cuda_units_staged:
// Note [Choosing what carries CUDA tensors]; on a machine with several GPUs,
// rank k on GPU k, over NCCL),
// for every sharding strategy; the flat buffers
// live on the GPU and are freed there between uses (Note [One seam for
// devices]), and GPU memory (the CUDA caching allocator's statistics) is the
// same after every step. Reported skipped, by name, without a GPU.

#include <ATen/Context.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "bf16_parity.h"
#include "detail/torch_compat.h"
#include "error_of.h"
#include "float16_scaling.h"
#include "frozen_net.h"
#include "multi_rank.h"
#include "offloaded_steps.h"
#include "rank_gpu.h"
#include "resharding_twins.h"
#include "settled_cuda_memory.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_cuda_units {

namespace nn = torch::nn;

nn::Sequential small_net() {
  return nn::Sequential(nn::Linear(7, 16), nn::GELU(), nn::LayerNorm(nn::LayerNormOptions({16})),
                        nn::Linear(16, 3));
}

// small_net() made with seed 0 on `device`: a reference and its twin start
// with the same weights.
nn::Sequential seeded_net_on(const torch::Device& device) {
  torch::manual_seed(0);
  nn::Sequential net = small_net();
  net->to(device);
  return net;
}

// One step of the GPU parity tests: `reference` (plain LibTorch) on the
// global batch of `step` (the ranks' batches concatenated), then `model` on
// this rank's block of it. The loss is the mean of the squared outputs: the
// sum made these little nets chaotic (a 1e-7 change to a gradient grew to
// 1e-4 within four steps), so the GPU's other summation order at another
// batch size failed the comparison at 3 ranks, as any change of order would.
// Returns the caching allocator's bytes in use (settled_cuda_allocated) just
// before the model's step began and just after it, both while the step's
// batch is still held.
struct StepMemory {
  int64_t before = 0;
  int64_t after = 0;
};
template <typename Model>
StepMemory gpu_step(nn::Sequential& reference, torch::optim::Optimizer& ref_opt, Model& model,
                    torch::optim::Optimizer& opt, int step, const std::string& what) {
  const int world = rank_and_world().second;
  torch::manual_seed(100 + step);
  const torch::Tensor global = torch::randn({5 * world, 7}).to(rank_gpu());
  ref_opt.zero_grad();
  reference->forward(global).pow(2).mean().backward();
  ref_opt.step();
  StepMemory memory;
  memory.before = settled_cuda_allocated(rank_gpu_index());
  opt.zero_grad();
  {
    const torch::Tensor out = model->forward(local_block(global));
    EXPECT_TRUE(out.is_cuda()) << what;
    out.pow(2).mean().backward();  // FSDP averages the ranks' gradients
  }
  opt.step();
  memory.after = settled_cuda_allocated(rank_gpu_index());
  return memory;
}

class CudaUnits : public ::testing::TestWithParam<int> {};

TEST_P(CudaUnits, TrainLikePlainLibTorchOnTheGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    const torch::Device gpu = rank_gpu();
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                          ShardingStrategy::kNoShard}) {
      const std::string what = to_string(strategy);
      nn::Sequential reference = seeded_net_on(gpu);
      nn::Sequential plain = seeded_net_on(gpu);
      FullyShardedDataParallel<nn::SequentialImpl> model(plain,
                                                         FSDPOptions().sharding_strategy(strategy));
      for (const auto& p : model->parameters()) EXPECT_TRUE(p.is_cuda()) << what;
      torch::optim::SGD ref_opt(reference->parameters(),
                                torch::optim::SGDOptions(0.1).momentum(0.9));
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      std::vector<int64_t> after_step, peak;
      for (int step = 0; step < 4; ++step) {
        compat::reset_cuda_peak(rank_gpu_index());
        const StepMemory memory = gpu_step(reference, ref_opt, model, opt, step, what);
        peak.push_back(compat::cuda_memory(rank_gpu_index()).peak_allocated);
        after_step.push_back(memory.after);
        expect_same_after_step(*model.ptr(), *reference.ptr(), what, step);
      }
      // From the second step on (the optimizer's state exists), the caching
      // allocator holds the same bytes after every step and peaks at the same
      // height within it: nothing a step gathers or reduces outlives it.
      for (size_t i = 2; i < after_step.size(); ++i) {
        EXPECT_EQ(after_step[i], after_step[1]) << what << " step " << i;
        EXPECT_EQ(peak[i], peak[1]) << what << " step " << i;
      }
    }
  });
}

// PyTorch's device_id: a model built on the CPU moves to the GPU named, and
// computes there what the same model moved by hand computes.
TEST_P(CudaUnits, DeviceIdMovesAModelBuiltOnTheCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    const torch::Device gpu = rank_gpu();
    torch::manual_seed(0);
    nn::Sequential reference = small_net();
    reference->to(gpu);
    torch::manual_seed(0);
    nn::Sequential plain = small_net();
    const torch::Tensor first_weight = plain->parameters()[0];
    FullyShardedDataParallel<nn::SequentialImpl> model(plain, FSDPOptions().device_id(gpu));
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.is_cuda());
    EXPECT_TRUE(first_weight.is_cuda()) << "the user's handle follows the module";
    // The habit of moving a built model changes nothing here, and moving the
    // units off their GPU is refused (Note [Module::to on a sharded model]).
    // torch::kCUDA is LibTorch's current device: GPU 0, where no program set
    // another, so rank k's on GPU k would be refused.
    if (gpu.index() == 0) model->to(torch::kCUDA);
    model->to(gpu, torch::kFloat);
    const std::string refused = error_of([&] { model->to(torch::kCPU); });
    EXPECT_NE(refused.find("to(cpu) would move or convert the FSDP unit around a "
                           "torch::nn::SequentialImpl (on " +
                           gpu.str() + ", Float)"),
              std::string::npos)
        << refused;
    torch::manual_seed(7);
    const torch::Tensor x = torch::randn({5, 7}).to(gpu);
    EXPECT_TRUE(torch::allclose(model->forward(x), reference->forward(x), 1e-5, 1e-6));
  });
}

// device_id(torch::kCUDA), without an index, as PyTorch's FSDP reads it:
// the current device (no error comparing "cuda" with "cuda:0"), where the
// units live and train.
TEST(CudaUnitsDevice, DeviceIdWithoutAnIndexIsTheCurrentDevice) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(1, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    const torch::Device current = c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice();
    torch::manual_seed(0);
    nn::Sequential plain = small_net();
    FullyShardedDataParallel<nn::SequentialImpl> model(plain,
                                                       FSDPOptions().device_id(torch::kCUDA));
    for (const auto& p : model->parameters()) EXPECT_EQ(p.device(), current);
    torch::manual_seed(7);
    const torch::Tensor x = torch::randn({5, 7}).to(current);
    model->forward(x).pow(2).mean().backward();
    for (const auto& p : model->parameters()) EXPECT_EQ(p.grad().device(), current);
  });
}

// A checkpointed region's dropout on the GPU draws the same mask when it is
// recomputed: the GPU's generator is restored as the CPU's is.
TEST(CudaCheckpointing, DropoutOnTheGpuRecomputesTheSameMask) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  const torch::Device gpu = rank_gpu();
  torch::manual_seed(0);
  nn::Linear lin(16, 16);
  lin->to(gpu);
  const torch::Tensor x = torch::randn({8, 16}).to(gpu).requires_grad_(true);
  const CheckpointedFunction fn = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{torch::dropout(lin->forward(in[0]), 0.5, /*train=*/true)};
  };
  torch::manual_seed(5);
  fn({x})[0].pow(2).sum().backward();
  const torch::Tensor want_x = x.grad().clone(), want_w = lin->weight.grad().clone();
  x.mutable_grad().reset();
  lin->weight.mutable_grad().reset();
  torch::manual_seed(5);
  activation_checkpoint(fn, {x}, lin->parameters())[0].pow(2).sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), want_x));
  EXPECT_TRUE(torch::equal(lin->weight.grad(), want_w));
}

// bf16 mixed precision on the GPU against plain LibTorch with the same casts
// on the GPU (the CPU's test_mixed_precision, on GPU 0).
TEST_P(CudaUnits, Bf16MixedPrecisionMatchesPlainBf16OnTheGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int rank, int world) {
    auto group = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    int64_t bf16_bytes = 0;
    bf16_parity::expect_bf16_matches_reference(group, rank, world, rank_gpu(), &bf16_bytes);
    EXPECT_GT(bf16_bytes, 0);
  });
}

// float16 parameters with ShardedGradScaler on the GPU (LibTorch's AMP
// kernel unscales there): the CPU's test_sharded_grad_scaler, on GPU 0.
TEST_P(CudaUnits, Float16WithShardedGradScalerOnTheGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    float16_scaling::expect_float16_trains_with_scale(rank_gpu());
  });
}

// CPU offload (Note [Shards in host memory]): shards, gradients and SGD's
// momentum in pinned host memory, parameters gathered and used on the GPU:
// the same results as plain LibTorch on the GPU, every step, and nothing of
// the model's stays in GPU memory from one step to the next (the caching
// allocator holds no more bytes after the sharded model's step than before
// its forward), for every strategy; the host's FusedSGD stepping the model
// beside backward (step_during_backward: this one-unit model's gradient,
// handed over at the end of backward, copied to the host in parts stepped as
// they land) bitwise as stepping after backward (units handed over while
// backward goes on: test_cuda_streams); bf16 mixed precision with offload
// against plain LibTorch with the same casts.
TEST_P(CudaUnits, CpuOffloadTrainsLikePlainLibTorchOnTheGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int rank, int world) {
    auto group = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    const torch::Device gpu = rank_gpu();
    const FSDPOptions offload = FSDPOptions().cpu_offload(CPUOffload().offload_params(true));
    // The model stepped beside backward gets each gradient in parts of 64
    // elements, each copied on the step-copy stream and stepped once its
    // event has passed (Note [Stepping a gradient as it lands]).
    ::setenv("FSDP_GRAD_PART_ELEMENTS", "64", 1);
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                          ShardingStrategy::kNoShard}) {
      const std::string what = std::string("offload ") + to_string(strategy);
      nn::Sequential reference = seeded_net_on(gpu);
      nn::Sequential plain = seeded_net_on(gpu);
      FullyShardedDataParallel<nn::SequentialImpl> model(
          plain, FSDPOptions(offload).sharding_strategy(strategy));
      for (const auto& p : model->parameters()) {
        EXPECT_TRUE(p.is_cpu()) << what << ": the optimizer steps host shards";
        EXPECT_TRUE(p.is_pinned()) << what;
      }
      const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
      torch::optim::SGD ref_opt(reference->parameters(), sgd);
      optim::FusedSGD opt(model->parameters(), sgd);
      nn::Sequential reference2 = seeded_net_on(gpu);
      torch::optim::SGD ref2_opt(reference2->parameters(), sgd);
      FullyShardedDataParallel<nn::SequentialImpl> during(
          seeded_net_on(gpu), FSDPOptions(offload).sharding_strategy(strategy));
      optim::FusedSGD during_opt(during->parameters(), sgd);
      during_opt.step_during_backward(*during.ptr());
      for (int step = 0; step < 4; ++step) {
        const StepMemory memory = gpu_step(reference, ref_opt, model, opt, step, what);
        // At most as much: the step beside backward of the other model, just
        // before, can leave a 1 KiB block of c10d's to be handed back during
        // this one (seen on an H100); the model's own bytes must not stay.
        EXPECT_LE(memory.after, memory.before) << what << " step " << step;
        expect_same_after_step(*model.ptr(), *reference.ptr(), what, step);
        gpu_step(reference2, ref2_opt, during, during_opt, step, what + " beside backward");
        const auto a = model->parameters();
        const auto b = during->parameters();
        ASSERT_EQ(a.size(), b.size());
        for (size_t i = 0; i < a.size(); ++i) {
          EXPECT_TRUE(torch::equal(a[i], b[i])) << what << " beside backward, step " << step;
        }
      }
    }
    int64_t bf16_bytes = 0;
    bf16_parity::expect_bf16_matches_reference(group, rank, world, gpu, &bf16_bytes,
                                               CPUOffload().offload_params(true));
    EXPECT_GT(bf16_bytes, 0);
  });
}

// What users do around their steps, on the GPU with offloaded units:
// validation under c10::InferenceMode (the collectives' continuations, the
// staged route's copies back included, run under it: Note [Inference
// mode]), then adversarial training (FGSM's input gradient, a backward that
// reaches no parameter and reduces nothing: Note [Backward with respect to
// inputs]) before the step on the perturbed batch; FusedSGD stepping the
// host shards after backward and beside it. Like plain LibTorch every step.
TEST_P(CudaUnits, InferenceModeAndInputGradientsWithOffload) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int world) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    const torch::Device gpu = rank_gpu();
    const FSDPOptions offload = FSDPOptions().cpu_offload(CPUOffload().offload_params(true));
    const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
    for (const bool beside : {false, true}) {
      const std::string what = beside ? "offload, beside backward" : "offload";
      nn::Sequential reference = seeded_net_on(gpu);
      FullyShardedDataParallel<nn::SequentialImpl> model(seeded_net_on(gpu), offload);
      torch::optim::SGD ref_opt(reference->parameters(), sgd);
      optim::FusedSGD opt(model->parameters(), sgd);
      if (beside) opt.step_during_backward(*model.ptr());
      for (int step = 0; step < 4; ++step) {
        const std::string at = what + " step " + std::to_string(step);
        torch::manual_seed(100 + step);
        const torch::Tensor x = torch::randn({5 * world, 7}).to(gpu);
        const torch::Tensor y = torch::randn({5 * world, 3}).to(gpu);
        {
          c10::InferenceMode inference;
          const torch::Tensor expected = reference->forward(x);
          const torch::Tensor got = model->forward(local_block(x));
          EXPECT_TRUE(got.is_cuda() && got.is_inference()) << at;
          EXPECT_TRUE(torch::allclose(got, local_block(expected), 1.3e-6, 1e-5)) << at;
        }
        const torch::Tensor ref_adv = fgsm(reference, x, y);
        const torch::Tensor adv = fgsm(model, local_block(x), local_block(y));
        EXPECT_TRUE(torch::allclose(adv, local_block(ref_adv))) << at;
        ref_opt.zero_grad();
        torch::mse_loss(reference->forward(ref_adv), y).backward();
        ref_opt.step();
        opt.zero_grad();
        torch::mse_loss(model->forward(adv), local_block(y)).backward();
        opt.step();
        expect_same_after_step(*model.ptr(), *reference.ptr(), what, step);
      }
    }
  });
}

// MixedPrecision::keep_low_precision_grads under offload on the GPU: each
// bf16 gradient copied to host memory as it is (half the bytes), on the
// step-copy stream, whole and in parts of 64 elements, and stepped by the
// host's FusedAdamW as its float values: bitwise the shards of the gradients
// cast to float32 on the GPU (tests/core/offloaded_steps.h).
TEST_P(CudaUnits, KeptBf16GradientsStepAsTheirFloatValues) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    offloaded_steps::expect_kept_grads_step_as_cast(rank_gpu(), "64");
  });
}

// Note [Copy-in at the step] on the GPU: the first unit's compute copy sent
// on the copy-in stream part by part as the host steps it, taken by the
// next forward's unshard, dropped after a write of the shard: bitwise the
// results without it (tests/core/offloaded_steps.h).
TEST_P(CudaUnits, FirstUnitCopiedInAtTheStep) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    offloaded_steps::expect_copy_in_at_step_as_without(rank_gpu(), "64");
  });
}

// Offload unit by unit, as FSDP2's offload_policy per fully_shard call: the
// two Linear layers offloaded (shards, gradients and momentum in pinned host
// memory), the root (the LayerNorm between them) kept on the GPU. FusedSGD
// steps the host shards with its fused kernel and the root's shard on the
// GPU with LibTorch's operations, after backward and beside it (the root's
// there from the optimizer's thread): like plain LibTorch every step.
TEST_P(CudaUnits, SomeUnitsOffloadedTheRootOnTheGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    const torch::Device gpu = rank_gpu();
    const FSDPOptions offload = FSDPOptions().cpu_offload(CPUOffload().offload_params(true));
    const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
    for (const bool beside : {false, true}) {
      const std::string what = beside ? "root on the GPU, beside backward" : "root on the GPU";
      nn::Sequential reference = seeded_net_on(gpu);
      nn::Sequential model = seeded_net_on(gpu);
      fully_shard(*model->ptr(0), offload);
      fully_shard(*model->ptr(3), offload);
      const std::vector<at::Tensor> params = fully_shard(*model).flat_parameters();
      int on_gpu = 0;
      for (const auto& p : params) on_gpu += p.is_cuda() ? 1 : 0;
      EXPECT_EQ(on_gpu, 1) << what << ": the root's shard only";
      torch::optim::SGD ref_opt(reference->parameters(), sgd);
      optim::FusedSGD opt(params, sgd);
      if (beside) opt.step_during_backward(*model);
      for (int step = 0; step < 4; ++step) {
        gpu_step(reference, ref_opt, model, opt, step, what);
        expect_same_after_step(*model, *reference, what, step);
      }
    }
  });
}

// Why the hybrid tests below cannot run here (empty: they can): their 2
// nodes of 2 ranks share one GPU.
std::string two_nodes_of_two_cannot_run() {
  if (!at::hasCUDA()) return "no CUDA device visible";
  if (std::getenv("FSDP_CUDA_BACKEND") == nullptr && at::getNumGPUs() > 1) {
    return "its 2 nodes of 2 ranks share one GPU over CUDA IPC: run it with "
           "CUDA_VISIBLE_DEVICES=0";
  }
  return "";
}

// Joins the job as rank `rank` of 2 nodes of 2 ranks sharing the GPU (the
// hybrid tests below): over CUDA IPC unless FSDP_CUDA_BACKEND says otherwise.
void join_as_two_nodes_of_two(int rank) {
  ProcessGroupOptions o = ProcessGroupOptions().local_rank(rank % 2).local_world_size(2).timeout(
      std::chrono::seconds(60));
  if (std::getenv("FSDP_CUDA_BACKEND") == nullptr) o.cuda_backend(CudaBackend::kCudaIpc);
  init_process_group(o);
}

// HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on the GPU: 4 ranks sharing it, laid
// out as 2 nodes of 2 (ProcessGroupOptions::local_world_size), trained
// every step against plain LibTorch on the same GPU. The node groups'
// reduce-scatters and the all-reduce across nodes chained behind them run
// on the GPU's streams as across GPUs. Their CUDA tensors go over CUDA IPC,
// asked for since the layout hides from NCCL's check that all four share
// one GPU; under test_cuda_units_staged, FSDP_CUDA_BACKEND stages them.
TEST(CudaHybridShard, TrainsLikePlainLibTorchOnTheGpu) {
  if (const std::string why = two_nodes_of_two_cannot_run(); !why.empty()) GTEST_SKIP() << why;
  run_ranks_ok(4, [](int rank, int) {
    join_as_two_nodes_of_two(rank);
    const torch::Device gpu = rank_gpu();
    for (auto strategy : {ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
      const std::string what = to_string(strategy);
      nn::Sequential reference = seeded_net_on(gpu);
      nn::Sequential plain = seeded_net_on(gpu);
      FullyShardedDataParallel<nn::SequentialImpl> model(plain,
                                                         FSDPOptions().sharding_strategy(strategy));
      torch::optim::SGD ref_opt(reference->parameters(),
                                torch::optim::SGDOptions(0.1).momentum(0.9));
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int step = 0; step < 4; ++step) {
        gpu_step(reference, ref_opt, model, opt, step, what);
        expect_same_after_step(*model.ptr(), *reference.ptr(), what, step);
      }
    }
  });
}

// Note [Accumulating within the node] on the GPU: three micro-batches a
// step, the first two reduce-scattered within the node only, the kept sum
// added on the chained stream before the one all-reduce across the nodes;
// trained every step against plain LibTorch accumulating all three, .grad
// untouched until the last micro-batch, and the caching allocator's bytes
// the same after every step from the second (the kept sum does not outlive
// its step). Layout and transport as the test above.
TEST(CudaHybridShard, AccumulatingWithinTheNodeOnTheGpu) {
  if (const std::string why = two_nodes_of_two_cannot_run(); !why.empty()) GTEST_SKIP() << why;
  run_ranks_ok(4, [](int rank, int) {
    join_as_two_nodes_of_two(rank);
    const torch::Device gpu = rank_gpu();
    const int world = rank_and_world().second;
    for (auto strategy : {ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
      const std::string what = std::string(to_string(strategy)) + " accumulating";
      nn::Sequential reference = seeded_net_on(gpu);
      FullyShardedDataParallel<nn::SequentialImpl> model(seeded_net_on(gpu),
                                                         FSDPOptions().sharding_strategy(strategy));
      torch::optim::SGD ref_opt(reference->parameters(),
                                torch::optim::SGDOptions(0.1).momentum(0.9));
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      std::vector<int64_t> after_step;
      for (int step = 0; step < 4; ++step) {
        ref_opt.zero_grad();
        opt.zero_grad();
        for (int m = 0; m < 3; ++m) {
          torch::manual_seed(100 + 3 * step + m);
          const torch::Tensor global = torch::randn({5 * world, 7}).to(gpu);
          reference->forward(global).pow(2).mean().backward();
          model->set_requires_all_reduce(m == 2);
          model->forward(local_block(global)).pow(2).mean().backward();
          for (const auto& p : model->parameters()) {
            if (m < 2 && p.grad().defined()) {
              EXPECT_EQ(p.grad().abs().max().item<double>(), 0) << what << " micro-batch " << m;
            }
          }
        }
        ref_opt.step();
        opt.step();
        after_step.push_back(settled_cuda_allocated(rank_gpu_index()));
        expect_same_after_step(*model.ptr(), *reference.ptr(), what, step);
      }
      for (size_t i = 2; i < after_step.size(); ++i) {
        EXPECT_EQ(after_step[i], after_step[1]) << what << " step " << i;
      }
    }
  });
}

// Note [Parameters backward reads without a gradient] on the GPU, where a
// freed buffer's memory is the caching allocator's to hand out at once: a
// LoRA unit, a frozen layer ahead of trainable ones and a unit frozen whole,
// with wrappers (plain and activation-checkpointed) and fully_shard, one
// forward, two forwards before one backward, and a gradient penalty,
// against plain LibTorch on the GPU every step.
TEST_P(CudaUnits, FrozenParametersReadLateOnTheGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    using frozen_net::Loss;
    using frozen_net::Made;
    for (const Made made : {Made::kWrappers, Made::kCheckpointed, Made::kFullyShard}) {
      for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
        for (const Loss how : {Loss::kOneForward, Loss::kTwoForwards, Loss::kGradientPenalty}) {
          frozen_net::train_and_compare(made, strategy, how, rank_gpu());
        }
      }
    }
  });
}

// Note [Resharding as the user says] on the GPU: gradient accumulation over
// three micro-batches with units kept gathered past the backwards that do
// not sync, and each layer's gather started by hand inside the forward
// (unshard(async_op): the copy-in stream, the forward waiting on the
// compute stream), train as plain LibTorch at 1-3 ranks, wrappers and
// fully_shard; from the second step on the caching allocator holds the same
// bytes after every step (nothing kept outlives the synchronising backward).
TEST_P(CudaUnits, ReshardingControlsOnTheGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  run_ranks_ok(GetParam(), [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    using resharding_twins::Build;
    for (const Build build : {Build::kWrappers, Build::kFullyShard}) {
      const std::string what = resharding_twins::to_string(build);
      resharding_twins::Twins t(build, FSDPOptions(), rank_gpu());
      t.layers->before_layer = [&](size_t i, const torch::Tensor&) {
        if (i + 1 < t.units.size()) t.units[i + 1]->unshard(/*async_op=*/true);
      };
      t.root->set_reshard_after_backward(false);
      std::vector<int64_t> after_step;
      t.after_step = [&] { after_step.push_back(settled_cuda_allocated(rank_gpu_index())); };
      for (int s = 0; s < 4; ++s) {
        t.step(
            s, 3, [&](int m) { t.root->set_requires_gradient_sync(m == 2); }, what);
      }
      for (size_t i = 2; i < after_step.size(); ++i) {
        EXPECT_EQ(after_step[i], after_step[1]) << what << " step " << i;
      }
    }
  });
}

// Under CPU offload the reduced gradient shards on the GPU go back to the
// caching allocator as their copies to host memory run (Note [Gradients to
// host memory]), not all at the end of backward: the step's peak is below
// that of the same model without offload, which holds its parameters and
// its gradients there (2 R, R the bytes of the reduced shards), by more
// than R and a quarter. With every shard held to the end (the first
// version), it was below by about R. At one rank, where the reduction runs
// on a GPU stream (NCCL) and the copies are queued behind it.
TEST(CudaOffloadMemory, ReducedShardsLeaveTheGpuAsTheirCopiesRun) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  if (const char* route = std::getenv("FSDP_CUDA_BACKEND");
      route && std::string(route) == "staged") {
    GTEST_SKIP() << "staged through the host, the reduction runs on no GPU stream: the copies "
                    "are queued at the end of backward";
  }
  run_ranks_ok(1, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    const torch::Device gpu = rank_gpu();
    constexpr int kLayers = 16;
    constexpr int64_t kWidth = 1024;
    const auto peak_of_step = [&](const FSDPOptions& opts) {
      torch::manual_seed(0);
      nn::Sequential seq;
      for (int i = 0; i < kLayers; ++i) seq->push_back(nn::Linear(kWidth, kWidth));
      seq->to(gpu);
      auto_wrap(seq, module_type_policy<nn::LinearImpl>(), opts);
      FullyShardedDataParallel<nn::SequentialImpl> model(seq, opts);
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
      const torch::Tensor x = torch::randn({16, kWidth}).to(gpu);
      int64_t peak = 0;
      for (int step = 0; step < 2; ++step) {  // the second: nothing made for the first time
        opt.zero_grad();
        settled_cuda_allocated(rank_gpu_index());
        compat::reset_cuda_peak(rank_gpu_index());
        model->forward(x).pow(2).mean().backward();
        settled_cuda_allocated(rank_gpu_index());
        peak = compat::cuda_memory(rank_gpu_index()).peak_allocated;
        opt.step();
      }
      return peak;
    };
    const int64_t reduced_bytes = kLayers * (kWidth * kWidth + kWidth) * 4;
    const int64_t on_gpu = peak_of_step(FSDPOptions());
    const int64_t offloaded =
        peak_of_step(FSDPOptions().cpu_offload(CPUOffload().offload_params(true)));
    std::printf("peak of a step: %.1f MiB on the GPU, %.1f MiB offloaded (R %.1f MiB)\n",
                on_gpu / 1048576.0, offloaded / 1048576.0, reduced_bytes / 1048576.0);
    EXPECT_GT(on_gpu - offloaded, reduced_bytes + reduced_bytes / 4)
        << "the offloaded step held the reduced shards on the GPU";
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, CudaUnits, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Ranks";
                         });

}  // namespace test_cuda_units
}  // namespace fsdp::testing
