#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <vector>

namespace fsdp {

/// What a listener (an optimizer that steps during backward: fsdp::optim's
/// step_during_backward) hears of each backward's reduced gradients. See
/// Note [Steps during backward] in src/runtime/root_state.cpp.
struct ReducedGradHooks {
  /// Who listens, for error messages ("fsdp::optim::FusedAdamW::step_during_backward").
  std::string owner;
  /// Called on the thread that runs backward once `params` (one unit's
  /// shard, or its use_orig_params pieces that got a gradient) hold this
  /// backward's reduced gradient in .grad: while backward goes on for a unit
  /// whose gradient was complete on this rank and whose reduction finished
  /// early, at the end of backward for the others.
  std::function<void(const std::vector<at::Tensor>& params)> on_reduced;
  /// Called when the root's forward begins, before any shard is read.
  std::function<void()> before_forward;
};

/// Installs `hooks` on every FSDP unit of `model`'s tree (the root, after
/// wrapping), replacing any installed before; hooks without on_reduced
/// remove them. Between steps, not inside forward or backward. With hooks
/// installed, clip_grad_norm_ is refused: the gradients may already have
/// been stepped.
void set_reduced_grad_hooks(torch::nn::Module& model, const ReducedGradHooks& hooks);

}  // namespace fsdp
