#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace fsdp {

/// A computation that activation_checkpoint() runs twice: once in forward
/// and again in backward, on the same inputs.
using CheckpointedFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// Runs `fn(inputs)` without keeping its activations for backward, and runs
/// it again in backward to get them: LibTorch's counterpart of PyTorch's
/// torch.utils.checkpoint.checkpoint. Gradients reach `inputs` and `params`
/// as through plain autograd, also when no input requires a gradient. See
/// Note [Activation checkpointing].
///
/// - `params`: the tensors `fn` uses besides its inputs that may need
///   gradients, usually a module's parameters(). A tensor left out gets no
///   gradient through `fn`.
/// - The random number generators' states (the CPU's, and those of the GPUs
///   the inputs are on) are saved and restored around the recomputation, so
///   dropout masks the same elements both times; the recomputation runs
///   under the autocast settings the forward ran under.
/// - Undefined tensors among `inputs` and the outputs are passed through; a
///   tensor among `params` listed twice, or among `inputs` too, gets its
///   gradient once.
/// - FSDP units run inside `fn` are gathered in forward and resharded as
///   usual, and gathered again in backward only for the recomputation, whose
///   gather replaces the one FSDP makes for backward (no extra all-gather).
/// - Without grad mode, or when neither an input nor a param requires a
///   gradient, `fn` simply runs once.
/// - Backward through it must run once per forward (or with retain_graph).
///   A backward with create_graph (a gradient penalty) builds the graph of
///   the recomputation, so a second backward differentiates it as without
///   checkpointing.
/// - `inputs` must not be modified in place between forward and backward
///   (autograd reports it, as for any saved tensor).
std::vector<at::Tensor> activation_checkpoint(const CheckpointedFunction& fn,
                                              const std::vector<at::Tensor>& inputs,
                                              const std::vector<at::Tensor>& params);

namespace detail {

/// Where this thread is with respect to activation_checkpoint(): outside it,
/// in its forward (grad mode off, activations not kept), or recomputing in
/// backward. FSDP units read it (Note [Activation checkpointing]).
enum class CheckpointPhase { kNone, kForward, kRecompute };

/// This thread's innermost CheckpointPhase.
CheckpointPhase checkpoint_phase();

}  // namespace detail
}  // namespace fsdp
