#pragma once

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <unordered_map>

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

  /// From the next step on, each step also writes `param`'s new values into
  /// `copy` (bfloat16 or float16, `param`'s number of elements, contiguous, on
  /// the CPU), in the same pass: the low-precision copy a GPU computes with
  /// when the parameters live in host memory. An undefined `copy` stops it.
  void set_low_precision_copy(const torch::Tensor& param, torch::Tensor copy);

 private:
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> low_precision_copies_;
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
