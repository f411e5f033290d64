#pragma once

// bf16 mixed precision against plain LibTorch with the same casts (fp32
// master weights cast to bf16 for the forward, bf16 gradients averaged over
// the ranks in bf16, cast to fp32 for the SGD step), on any device: shared by
// test_mixed_precision (CPU) and test_cuda_units (GPU).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "comm/counting_process_group.h"
#include "core/flat_parameter.h"
#include "test_models.h"

namespace fsdp::testing {
namespace bf16_parity {

namespace nn = torch::nn;

inline nn::Sequential make_model(const torch::Device& device = torch::kCPU) {
  torch::manual_seed(0);
  nn::Sequential m(nn::Linear(8, 16), nn::Tanh(), nn::Linear(16, 16), nn::Tanh(),
                   nn::Linear(16, 4));
  m->to(device);
  return m;
}

inline torch::Tensor batch(int step, int rank, const torch::Device& device = torch::kCPU) {
  torch::manual_seed(100 + 10 * step + rank);
  return torch::randn({6, 8}).to(device);
}

inline torch::Tensor loss_of(const torch::Tensor& out) {
  return out.to(torch::kFloat).pow(2).mean();
}

// Plain LibTorch with the same casts: returns the fp32 master weights after
// each step.
inline std::vector<std::map<std::string, torch::Tensor>> reference_training(
    int world, int steps, const torch::Device& device = torch::kCPU) {
  nn::Sequential master = make_model(device);
  auto work = std::dynamic_pointer_cast<nn::SequentialImpl>(master->clone());
  auto master_params = master->named_parameters();
  auto work_params = work->named_parameters();
  torch::optim::SGD opt(master->parameters(), torch::optim::SGDOptions(0.5));
  std::vector<std::map<std::string, torch::Tensor>> out;
  for (int step = 0; step < steps; ++step) {
    std::map<std::string, torch::Tensor> sum;  // bf16, summed in rank order
    for (int r = 0; r < world; ++r) {
      for (auto& p : work_params) {
        p.value().set_data(master_params[p.key()].detach().to(torch::kBFloat16));
        p.value().mutable_grad().reset();
      }
      loss_of(work->forward(batch(step, r, device).to(torch::kBFloat16))).backward();
      add_grads(sum, work_params);
    }
    for (auto& p : master_params) {
      p.value().mutable_grad() = sum[p.key()].div(world).to(torch::kFloat);
    }
    opt.step();
    std::map<std::string, torch::Tensor> snapshot;
    for (auto& p : master_params) snapshot[p.key()] = p.value().detach().clone();
    out.push_back(snapshot);
  }
  return out;
}

// This rank's shard of unit `path`'s parameters, taken from full values.
inline torch::Tensor expected_shard(const FlatParameter& flat, const std::string& path,
                                    const std::map<std::string, torch::Tensor>& full) {
  std::vector<torch::Tensor> pieces;
  for (const auto& s : flat.slots()) pieces.push_back(full.at(path + "." + s.name).reshape({-1}));
  torch::Tensor cat = torch::cat(pieces);
  cat = torch::constant_pad_nd(cat, {0, flat.padded_numel() - cat.numel()});
  return cat.narrow(0, flat.shard_offset(), flat.shard().numel());
}

// 5 bf16 steps under FULL_SHARD, SHARD_GRAD_OP and NO_SHARD on `device`,
// each unit's fp32 shard compared with the reference after every step; the
// bytes FULL_SHARD all-gathered in `*bf16_bytes`. With `offload`, the fp32
// shards live in host memory.
inline void expect_bf16_matches_reference(const std::shared_ptr<ProcessGroup>& group, int rank,
                                          int world, const torch::Device& device,
                                          int64_t* bf16_bytes,
                                          const CPUOffload& offload = CPUOffload()) {
  constexpr int kSteps = 5;
  const auto reference = reference_training(world, kSteps, device);

  for (const ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
    SCOPED_TRACE(to_string(strategy));
    auto counting = std::make_shared<CountingProcessGroup>(group);
    nn::Sequential model = make_model(device);
    const auto o = FSDPOptions()
                       .process_group(counting)
                       .sharding_strategy(strategy)
                       .mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16))
                       .cpu_offload(offload)
                       .check_forward_order(false);  // count parameter gathers only
    auto units = auto_wrap(model, module_type_policy<nn::LinearImpl>(), o);
    ASSERT_EQ(units.size(), 3u);
    FullyShardedDataParallel<nn::SequentialImpl> root(model, o);
    torch::optim::SGD opt(root->parameters(), torch::optim::SGDOptions(0.5));
    const torch::Tensor init0 = units[0].unit->flat_param()->shard().detach().clone();

    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      torch::Tensor out = root->forward(batch(step, rank, device));  // cast to bf16 by the root
      EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
      loss_of(out).backward();
      opt.step();
      for (const auto& u : units) {
        const FlatParameter& flat = *u.unit->flat_param();
        EXPECT_EQ(flat.param_dtype(), torch::kBFloat16);
        EXPECT_EQ(flat.shard().scalar_type(), torch::kFloat) << "full-precision shard";
        EXPECT_EQ(flat.shard().device(),
                  offload.offload_params() ? torch::Device(torch::kCPU) : device);
        ASSERT_TRUE(flat.shard().grad().defined());
        EXPECT_EQ(flat.shard().grad().scalar_type(), torch::kFloat);
        // On the shard's device: the host's under offload.
        const torch::Tensor want =
            expected_shard(flat, u.path, reference[step]).to(flat.shard().device());
        EXPECT_TRUE(torch::allclose(flat.shard(), want, /*rtol=*/1.6e-2, /*atol=*/1e-3))
            << "unit " << u.path << " step " << step << " max diff "
            << (flat.shard() - want).abs().max().item<double>();
      }
    }
    EXPECT_GT((units[0].unit->flat_param()->shard() - init0).abs().max().item<double>(), 1e-2)
        << "training moved the weights beyond the tolerance";
    for (at::ScalarType t : counting->reduced_dtypes()) EXPECT_EQ(t, torch::kBFloat16);
    EXPECT_EQ(model->named_parameters()["0.weight"].scalar_type(), torch::kBFloat16);
    EXPECT_EQ(model->named_parameters()["0.weight"].device(), device);
    if (strategy == ShardingStrategy::kFullShard) *bf16_bytes = counting->gathered_bytes;
  }
}

}  // namespace bf16_parity
}  // namespace fsdp::testing
