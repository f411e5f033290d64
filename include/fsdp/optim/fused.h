#pragma once

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace fsdp::optim {

/// torch::optim::AdamW with a fused step: one pass over each parameter's
/// values, gradient and both moments, on all of LibTorch's intra-op threads,
/// instead of a pass per tensor operation (Note [Fused host optimizers] in
/// src/optim/fused_kernels.h). Everything else is AdamW's own: the options,
/// parameter groups, state (AdamWParamState), torch::save and torch::load,
/// and libfsdp's checkpoints. Results equal AdamW's to float rounding.
/// Contiguous float32 CPU parameters with gradients of the same layout take
/// the fused path; any other parameter is stepped as AdamW steps it.
class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;

  /// One AdamW step over every parameter that has a gradient.
  torch::Tensor step(LossClosure closure = nullptr) override;
};

/// torch::optim::SGD (momentum, dampening, Nesterov, weight decay) with a
/// fused step, as FusedAdamW is to AdamW.
class FusedSGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;

  /// One SGD step over every parameter that has a gradient.
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace fsdp::optim
