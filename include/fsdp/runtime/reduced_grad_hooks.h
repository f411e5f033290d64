#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp {

/// Elements [begin, end) of ReducedGrad::params[param].
struct ParamRange {
  size_t param = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

/// Part of a reduced gradient that lands in host memory on its own, so that
/// a listener can step it while the rest is still being copied (Note
/// [Stepping a gradient as it lands] in src/runtime/reduced_grad.cpp).
struct GradPart {
  /// Blocks until this part's elements of the params' .grad are in place.
  /// Call it after complete(), on the same thread, for the parts in order.
  std::function<void()> arrived;
  /// The elements it brings. The parts' ranges, in order, cover each param's
  /// elements once, from 0 up.
  std::vector<ParamRange> ranges;
};

/// One unit's reduced gradient, handed to ReducedGradHooks::on_reduced.
struct ReducedGrad {
  /// What the optimizer steps for the unit (its flat shard, or its
  /// use_orig_params pieces that get a gradient).
  std::vector<at::Tensor> params;
  /// Waits for the reduction (a host wait, on any thread) and sets the
  /// params' .grad. Call it once, before reading them; empty when .grad is
  /// set already (a gradient handed over at the end of backward).
  std::function<void()> complete;
  /// Empty, or (only for hooks that take parts) the parts in which the
  /// .grad values complete() set arrive: read an element only after its
  /// part's arrived() returned.
  std::vector<GradPart> parts;
  /// Empty, or to call with each range of params once the listener has
  /// stepped it (a part's ranges, or each whole parameter), in order: the
  /// unit sends the new values on to its device ahead of the next forward
  /// (Note [Copy-in at the step] in src/core/copy_in_ahead.h).
  std::function<void(const ParamRange& range)> stepped;
  /// The stream backward handed this over on (its current stream on the
  /// unit's GPU; the CPU's default stream for a unit on the CPU). Run the
  /// step's device work on it (complete() and stepped too): then the next
  /// forward, queued on the same stream, reads what the step wrote, as
  /// plain LibTorch's does under a user's CUDAStreamGuard.
  c10::Stream stream{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
};

/// What a listener (an optimizer that steps during backward: fsdp::optim's
/// step_during_backward) hears of each backward's reduced gradients. See
/// Note [Steps during backward] in src/runtime/root_state.cpp.
struct ReducedGradHooks {
  /// Who listens, for error messages ("fsdp::optim::FusedAdamW::step_during_backward").
  std::string owner;
  /// Called on the thread that runs backward with each unit's gradient of
  /// this backward: as soon as its reduction is launched, for a unit whose
  /// gradient the end of backward cannot change (then complete() waits for
  /// the reduction), else at the end of backward (.grad already set).
  std::function<void(ReducedGrad grad)> on_reduced;
  /// Called when the root's forward begins, before any shard is read.
  std::function<void()> before_forward;
  /// Called when a backward begins (its first hook, on the thread that runs
  /// it), before any shard is read: a throw there fails that backward.
  std::function<void()> before_backward;
  /// Called at the end of each backward that finished its reductions, on
  /// the thread that ran it, after the last on_reduced; backward returns
  /// once it has (a listener waits there for its steps: when backward
  /// returns, .grad and the shards hold what a step after it would see). A
  /// throw there fails that backward.
  std::function<void()> after_backward;
  /// Called when model->zero_grad() begins, before any .grad is cleared (a
  /// listener still stepping, after a backward that threw midway, waits
  /// there, so that the .grad it sets and the clearing do not race).
  std::function<void()> before_zero_grad;
  /// Empty, or whether the listener is still there: once it says no (an
  /// optimizer destroyed before its model) the hooks act as if removed, and
  /// gradients go to .grad as without them.
  std::function<bool()> listening;
  /// Called before libfsdp reads or writes the model's state outside
  /// forward and backward (state dicts, checkpoints, SummonFullParams,
  /// torch::save and torch::load of the model): a throw there refuses it.
  std::function<void()> before_state_use;
  /// Whether on_reduced may hand a large gradient over in ReducedGrad::parts
  /// (each part readable once it has landed) instead of whole.
  bool takes_parts = false;
};

/// Installs `hooks` on every FSDP unit of `model`'s tree (the root, after
/// wrapping), replacing any installed before; hooks without on_reduced
/// remove them. Between steps, not inside forward or backward. With hooks
/// installed, clip_grad_norm_ is refused: the gradients may already have
/// been stepped.
void set_reduced_grad_hooks(torch::nn::Module& model, const ReducedGradHooks& hooks);

}  // namespace fsdp
