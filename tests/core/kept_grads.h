#pragma once

// MixedPrecision::keep_low_precision_grads under CPU offload, on any device:
// the reduced gradient stays in the reduce dtype (bfloat16), half the bytes
// to host memory, and the fused optimizer reads it as its float values
// (Note [Fused host optimizers]). Shared by test_step_during_backward (CPU)
// and test_cuda_units (GPU).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace kept_grads {

namespace nn = torch::nn;

// A Linear-Tanh-Linear-Tanh-Linear net on `device`, each Linear a unit, the
// Sequential the root: the optimizer's parameters.
inline std::vector<at::Tensor> sharded_net(nn::Sequential& net, const torch::Device& device,
                                           const FSDPOptions& options) {
  torch::manual_seed(0);
  net = nn::Sequential(nn::Linear(7, 16), nn::Tanh(), nn::Linear(16, 16), nn::Tanh(),
                       nn::Linear(16, 3));
  net->to(device);
  for (const size_t i : {0, 2, 4}) fully_shard(*net->ptr(i), options);
  return fully_shard(*net, options).flat_parameters();
}

// Three nets with bf16 compute and reduction, offloaded, trained alike on
// this rank's block of the same batches: gradients cast to float32 and
// stepped by FusedAdamW during backward; kept in bf16 and stepped during
// backward; kept and stepped after backward. The kept ones' .grad is bf16,
// and their shards are bitwise those of the cast one after every step, with
// the gradients whole and in parts of `part_elements` ("0": whole), for flat
// shards and use_orig_params.
inline void expect_kept_grads_step_as_cast(const torch::Device& device, const char* part_elements) {
  const int world = rank_and_world().second;
  const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  for (const char* parts : {"0", part_elements}) {
    ::setenv("FSDP_GRAD_PART_ELEMENTS", parts, 1);
    for (const bool orig : {false, true}) {
      const std::string what =
          std::string(orig ? "use_orig_params" : "flat") + ", parts of " + parts;
      const auto options = [orig](bool keep) {
        return FSDPOptions()
            .use_orig_params(orig)
            .cpu_offload(CPUOffload().offload_params(true))
            .mixed_precision(MixedPrecision()
                                 .param_dtype(at::kBFloat16)
                                 .reduce_dtype(at::kBFloat16)
                                 .keep_low_precision_grads(keep));
      };
      nn::Sequential cast{nullptr}, kept{nullptr}, kept_after{nullptr};
      const std::vector<at::Tensor> cast_params = sharded_net(cast, device, options(false));
      const std::vector<at::Tensor> kept_params = sharded_net(kept, device, options(true));
      const std::vector<at::Tensor> after_params = sharded_net(kept_after, device, options(true));
      optim::FusedAdamW cast_opt(cast_params, adamw);
      optim::FusedAdamW kept_opt(kept_params, adamw);
      optim::FusedAdamW after_opt(after_params, adamw);
      cast_opt.step_during_backward(*cast);
      kept_opt.step_during_backward(*kept);
      for (int step = 0; step < 3; ++step) {
        torch::manual_seed(50 + step);
        const torch::Tensor x = torch::randn({4 * world, 7}).to(device);
        for (nn::Sequential* net : {&cast, &kept, &kept_after}) {
          (*net)->zero_grad();
          (*net)->forward(local_block(x)).to(at::kFloat).pow(2).mean().backward();
        }
        for (const at::Tensor& p : after_params) {
          if (p.grad().defined()) EXPECT_EQ(p.grad().scalar_type(), at::kBFloat16) << what;
        }
        cast_opt.step();
        kept_opt.step();
        after_opt.step();
        for (size_t i = 0; i < cast_params.size(); ++i) {
          const std::string at =
              what + ", parameter " + std::to_string(i) + ", step " + std::to_string(step);
          EXPECT_TRUE(torch::equal(kept_params[i], cast_params[i])) << at << ", during";
          EXPECT_TRUE(torch::equal(after_params[i], cast_params[i])) << at << ", after";
        }
      }
    }
  }
  ::unsetenv("FSDP_GRAD_PART_ELEMENTS");
}

}  // namespace kept_grads
}  // namespace fsdp::testing
