#pragma once

#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <memory>
#include <unordered_map>

namespace fsdp::detail {
class BackwardSteps;  // src/optim/backward_steps.h
}  // namespace fsdp::detail

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
  /// Lets what steps during backward finish first.
  ~FusedAdamW() override;

  /// One AdamW step over every parameter that has a gradient.
  torch::Tensor step(LossClosure closure = nullptr) override;

  /// Optimizer::zero_grad, once the steps of a backward that threw midway
  /// are done (under step_during_backward(), they may still be running).
  template <typename... SetToNone>
  void zero_grad(SetToNone... set_to_none) {
    wait_for_steps();
    torch::optim::AdamW::zero_grad(set_to_none...);
  }
  /// AdamW's, refused (on every rank) between a backward that stepped units
  /// and step(), where the state would be half of one step and half of the other.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// As save().
  void load(torch::serialize::InputArchive& archive) override;

  /// From the next step on, each step also writes `param`'s new values into
  /// `copy` (bfloat16 or float16, `param`'s number of elements, contiguous, on
  /// the CPU), in the same pass: the low-precision copy a GPU computes with
  /// when the parameters live in host memory. An undefined `copy` stops it.
  void set_low_precision_copy(const torch::Tensor& param, torch::Tensor copy);

  /// From the next backward on, steps each FSDP unit of `model` (the wrapped
  /// root) on a thread of its own, which waits for the unit's gradient
  /// reduction as soon as backward launches it, while backward goes on (Note
  /// [Steps during backward] in
  /// src/runtime/root_state.cpp); backward returns once those steps are
  /// done, and step() steps what no unit handed over. The results are
  /// step()'s. Call step() after every backward (accumulate inside
  /// model->no_sync()), and before reading the optimizer's state;
  /// clip_grad_norm_ is refused, step()'s closure too. Calling it again
  /// before step() is refused (it would step twice).
  void step_during_backward(torch::nn::Module& model);
  /// Whether step_during_backward() is on (ShardedGradScaler refuses it: a
  /// step already taken cannot be skipped; its scale() is refused while any
  /// optimizer of the process steps during backward, before a backward).
  bool steps_during_backward() const { return backward_steps_ != nullptr; }

  /// For `model`'s units offloaded to host memory under mixed precision:
  /// from the next step on, writes each unit's host copy in the compute
  /// dtype in the same pass (set_low_precision_copy), which each unshard then
  /// sends to the GPU instead of the fp32 shard: half the bytes over PCIe for
  /// bf16, no cast per unshard (fsdp::offloaded_compute_copies). Parameters
  /// of `model` that this optimizer does not step are left out.
  void write_compute_copies(torch::nn::Module& model);

 private:
  // Waits for what steps during backward (rethrowing its error).
  void wait_for_steps() const;
  // Elements [begin, end) of `p` (Note [Stepping a gradient as it lands]).
  void step_param(at::Tensor& p, const at::Tensor& grad, const torch::optim::AdamWOptions& o,
                  int64_t begin, int64_t end);

  std::unordered_map<const c10::TensorImpl*, torch::Tensor> low_precision_copies_;
  std::shared_ptr<detail::BackwardSteps> backward_steps_;
};

/// torch::optim::SGD (momentum, dampening, Nesterov, weight decay) with a
/// fused step, as FusedAdamW is to AdamW.
class FusedSGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  /// As FusedAdamW's.
  ~FusedSGD() override;

  /// One SGD step over every parameter that has a gradient.
  torch::Tensor step(LossClosure closure = nullptr) override;

  /// As FusedAdamW::zero_grad.
  template <typename... SetToNone>
  void zero_grad(SetToNone... set_to_none) {
    wait_for_steps();
    torch::optim::SGD::zero_grad(set_to_none...);
  }
  /// As FusedAdamW::save.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// As FusedAdamW::load.
  void load(torch::serialize::InputArchive& archive) override;

  /// As FusedAdamW::step_during_backward.
  void step_during_backward(torch::nn::Module& model);
  /// As FusedAdamW::steps_during_backward.
  bool steps_during_backward() const { return backward_steps_ != nullptr; }

 private:
  void wait_for_steps() const;
  // Elements [begin, end) of `p`, as FusedAdamW's.
  void step_param(at::Tensor& p, const at::Tensor& grad, const torch::optim::SGDOptions& o,
                  int64_t begin, int64_t end);
  // Whether `p`'s momentum buffer in `s` is the one made at this step's
  // first range.
  bool made_this_step(const at::Tensor& p, const torch::optim::SGDParamState& s) const;

  std::shared_ptr<detail::BackwardSteps> backward_steps_;
  // Parameters whose momentum buffer was made at the first range of this
  // step, and that buffer (held weakly: a buffer a load put in its place,
  // maybe at the same address, is not it): their later ranges take the
  // gradient as it is too.
  using WeakBuffer = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  std::unordered_map<const c10::TensorImpl*, WeakBuffer> fresh_buffers_;
};

}  // namespace fsdp::optim
