#pragma once

// Offloaded units stepped beside backward by the host's FusedAdamW, on any
// device; shared by the CPU's tests (test_step_during_backward,
// test_cpu_offload) and the GPU's (test_cuda_units):
// - MixedPrecision::keep_low_precision_grads: the reduced gradient stays in
//   the compute dtype (bfloat16), half the bytes to host memory, and the fused
//   optimizer reads it as its float values (Note [Fused host optimizers]);
// - the next forward's first unit sent to its device by its step (Note
//   [Copy-in at the step]).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/fsdp.h>

#include "core/copy_in_ahead.h"
#include "core/flat_parameter.h"
#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace offloaded_steps {

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
// backward; kept and stepped after backward; each step also writing the
// bf16 copies unsharding sends. The kept ones' .grad is bf16,
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
      // As a GPU user would: bf16 host copies written by the step, sent by
      // each unshard (Note [A host copy in the compute dtype]).
      for (auto [net, opt] : {std::pair{&cast, &cast_opt}, std::pair{&kept, &kept_opt},
                              std::pair{&kept_after, &after_opt}}) {
        opt->write_compute_copies(**net);
      }
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

// Note [Copy-in at the step]: two nets with bf16 compute copies written by
// FusedAdamW beside backward, one with FSDP_COPY_IN_AT_STEP=0, trained alike:
// after every step the first unit of the forward order (the first Linear)
// has its copy on the device ready and the other none; the next forward
// takes it; the shards are bitwise the same every step, the gradients whole
// and in parts of `part_elements`. A write of that unit's shard between a
// step and the next forward (before step 2) makes the unshard drop the copy
// and cast its host copy anew (Note [A host copy in the compute dtype]),
// which the step sends again: still the same results.
inline void expect_copy_in_at_step_as_without(const torch::Device& device,
                                              const char* part_elements) {
  const int world = rank_and_world().second;
  const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  const FSDPOptions options = FSDPOptions()
                                  .cpu_offload(CPUOffload().offload_params(true))
                                  .mixed_precision(MixedPrecision().param_dtype(at::kBFloat16));
  for (const char* parts : {"0", part_elements}) {
    ::setenv("FSDP_GRAD_PART_ELEMENTS", parts, 1);
    const std::string what = std::string("parts of ") + parts;
    nn::Sequential ahead{nullptr}, plain{nullptr};
    const std::vector<at::Tensor> ahead_params = sharded_net(ahead, device, options);
    const std::vector<at::Tensor> plain_params = sharded_net(plain, device, options);
    optim::FusedAdamW ahead_opt(ahead_params, adamw);
    optim::FusedAdamW plain_opt(plain_params, adamw);
    for (auto [net, opt] : {std::pair{&ahead, &ahead_opt}, std::pair{&plain, &plain_opt}}) {
      opt->write_compute_copies(**net);
      opt->step_during_backward(**net);
    }
    // The first Linear's unit: the first the forward unshards.
    const auto first_flat = [](nn::Sequential& net) { return unit_of(*net->ptr(0))->flat_param(); };
    const FlatParameter* first = first_flat(ahead);
    for (int step = 0; step < 4; ++step) {
      const std::string at = what + ", step " + std::to_string(step);
      if (step == 2) {
        at::NoGradGuard no_grad;
        first_flat(ahead)->shard().add_(0.25);
        first_flat(plain)->shard().add_(0.25);
      }
      torch::manual_seed(60 + step);
      const torch::Tensor x = torch::randn({4 * world, 7}).to(device);
      for (auto [net, opt] : {std::pair{&ahead, &ahead_opt}, std::pair{&plain, &plain_opt}}) {
        if (net == &plain) ::setenv("FSDP_COPY_IN_AT_STEP", "0", 1);
        (*net)->zero_grad();
        (*net)->forward(local_block(x)).to(at::kFloat).pow(2).mean().backward();
        opt->step();
        ::unsetenv("FSDP_COPY_IN_AT_STEP");
      }
      // Step 0's hand-over came after the forward order was recorded, so
      // step 0's forward took no copy; step 2's dropped the one sent before
      // the write; steps 1 and 3 took theirs.
      ASSERT_NE(first->copy_in_ahead(), nullptr) << at;
      EXPECT_EQ(first->copy_in_ahead()->state(), detail::CopyInAhead::State::kReady) << at;
      EXPECT_EQ(first->copy_in_ahead()->taken(), step == 0 ? 0 : step < 3 ? 1 : 2) << at;
      EXPECT_EQ(first_flat(plain)->copy_in_ahead(), nullptr) << at;
      for (size_t i = 0; i < ahead_params.size(); ++i) {
        EXPECT_TRUE(torch::equal(ahead_params[i], plain_params[i])) << at << ", shard " << i;
      }
    }
  }
  ::unsetenv("FSDP_GRAD_PART_ELEMENTS");
}

}  // namespace offloaded_steps
}  // namespace fsdp::testing
