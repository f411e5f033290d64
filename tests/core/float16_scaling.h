#pragma once

// ShardedGradScaler under float16 parameters, on any device: shared by
// test_sharded_grad_scaler (CPU) and test_cuda_units (GPU, where LibTorch's
// AMP kernel does the unscaling).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <string>

#include <fsdp/fsdp.h>

#include "test_models.h"

namespace fsdp::testing {
namespace float16_scaling {

namespace nn = torch::nn;

// The model under test, as users shard it: Net's units wrapped by hand, or
// Net made plain and fully_shard'ed per Linear. Same initial weights as a
// plain Net made after torch::manual_seed(0); built on the CPU and moved to a
// GPU by device_id, as PyTorch's FSDP users do.
struct Sharded {
  Sharded(bool wrapped, FSDPOptions o, const torch::Device& device)
      : Sharded(wrapped, device.is_cpu() ? o : o.device_id(device)) {}
  Sharded(bool wrapped, const FSDPOptions& o)
      : wrapper((torch::manual_seed(0), std::make_shared<NetImpl>(true, o)), o),
        plain((torch::manual_seed(0), Net(false, FSDPOptions()))),
        root(wrapped ? *units_of(*wrapper).front()
                     : fully_shard(plain, module_type_policy<nn::LinearImpl>(), o)),
        wrapped(wrapped) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return wrapped ? wrapper->forward(x) : plain->forward(x);
  }
  nn::Module& module() { return wrapped ? static_cast<nn::Module&>(*wrapper) : *plain; }
  std::string name() const { return wrapped ? "wrapped" : "fully_shard"; }

  FullyShardedDataParallel<NetImpl> wrapper;
  Net plain;
  Unit& root;
  bool wrapped;
};

// Float16 parameters (float32 shards and reduction) on `device` with a loss
// whose gradients are below float16's smallest subnormal: unscaled they flush
// to zero and the model does not move; scaled they train as float32 plain
// LibTorch does, to float16's rounding. Inside the ranks of a group.
inline void expect_float16_trains_with_scale(const torch::Device& device) {
  const int world = rank_and_world().second;
  const FSDPOptions options = FSDPOptions().mixed_precision(
      MixedPrecision().param_dtype(torch::kHalf).reduce_dtype(torch::kFloat));
  const double tiny = std::ldexp(1.0, -30);  // the loss's factor; the lr's inverse
  for (const bool scaled : {true, false}) {
    for (const bool wrapped : {true, false}) {
      torch::manual_seed(0);
      Net reference(false, FSDPOptions());
      reference->to(device);
      Sharded model(wrapped, options, device);
      const auto sgd = torch::optim::SGDOptions(0.05 / tiny);
      torch::optim::SGD ref_opt(reference->parameters(), sgd);
      torch::optim::SGD opt(model.root.flat_parameters(), sgd);
      ShardedGradScaler scaler(GradScalerOptions().init_scale(std::ldexp(1.0, 40)).enabled(scaled));
      std::string trace;  // per step: scale, loss, stepped or not, shards finite or not
      for (int step = 0; step < 4; ++step) {
        torch::manual_seed(step);
        const torch::Tensor x = torch::randn({4 * world, 7}).to(device);
        opt.zero_grad();
        const torch::Tensor out = model.forward(local_block(x)).to(torch::kFloat);
        const torch::Tensor loss = out.pow(2).sum() * tiny;
        trace += "\n  step " + std::to_string(step) + ": scale " +
                 std::to_string(scaler.get_scale()) + ", loss " +
                 std::to_string(loss.item<double>());
        scaler.scale(loss).backward();
        const bool stepped = scaler.step(opt);  // false where float16 overflowed
        scaler.update();
        trace += stepped ? ", stepped" : ", skipped";
        for (const torch::Tensor& p : model.root.flat_parameters()) {
          if (!p.isfinite().all().item<bool>()) trace += ", a shard not finite";
        }
        ref_opt.zero_grad();
        (reference->forward(x).pow(2).sum() * tiny / world).backward();
        if (stepped) ref_opt.step();
      }
      SummonFullParams full(model.module());
      double worst = 0;
      for (const auto& p : reference->named_parameters()) {
        const torch::Tensor mine = model.module().named_parameters()[p.key()].to(torch::kFloat);
        const double diff = (mine - p.value()).abs().max().item<double>();
        worst = std::isnan(diff) ? INFINITY : std::max(worst, diff);  // std::max drops a NaN
      }
      const std::string what = std::string(wrapped ? "wrapped" : "fully_shard") +
                               (scaled ? " scaled" : " unscaled") + " on " + device.str() + trace;
      if (scaled) {
        EXPECT_LT(worst, 5e-3) << what;  // 4e-4 measured on the CPU
      } else {
        EXPECT_GT(worst, 0.1) << what << ": unscaled float16 gradients trained";  // 0.23
      }
    }
  }
}

}  // namespace float16_scaling
}  // namespace fsdp::testing
