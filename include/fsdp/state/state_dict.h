#pragma once

// Full state dicts of a sharded model and its optimizer, in memory, under the
// original parameter and buffer names.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <string>

namespace fsdp {

/// Options of full_state_dict() and full_optim_state_dict(), and of their
/// loads (broadcast_from_rank0).
struct StateDictOptions {
  /// Only rank 0 receives the tensors (the others return an empty dict but
  /// still take part in the gathers).
  TORCH_ARG(bool, rank0_only) = false;
  /// The tensors are in host memory (FSDP1's FullStateDictConfig
  /// offload_to_cpu): each unit's full values leave the GPU as soon as they
  /// are gathered, so a model larger than the GPU can be gathered (with
  /// rank0_only, into rank 0's host memory alone).
  TORCH_ARG(bool, offload_to_cpu) = false;
  /// For the loads (PyTorch's StateDictOptions of the same name): only rank
  /// 0's dict is read, and sent to the other ranks, which may pass an empty
  /// one (as rank0_only gives them). Collective; each rank holds the whole
  /// dict while it loads, as when each loads it from a file.
  TORCH_ARG(bool, broadcast_from_rank0) = false;
  /// For load_full_state_dict only (PyTorch's load_state_dict(strict)): false
  /// loads the entries the dict and the model share, leaves the rest as it
  /// is, and returns the names it skipped instead of refusing them. A shape
  /// or dtype that does not fit is refused either way.
  TORCH_ARG(bool, strict) = true;
};

/// What a non-strict load_full_state_dict skipped (PyTorch's
/// _IncompatibleKeys); empty after a strict one. The same on every rank.
struct IncompatibleKeys {
  /// The model's parameters and buffers the dict has no entry for (they
  /// keep their values).
  std::vector<std::string> missing_keys;
  /// The dict's entries the model has no parameter or buffer for.
  std::vector<std::string> unexpected_keys;
};

/// The full parameters and buffers of `model` (FSDP-wrapped or plain), as
/// copies under their original names ("block.0.weight"), in the order of
/// the units (pre-order), then unsharded parameters, then buffers. Gathered
/// one unit at a time, so at most one unit's full parameters exist besides
/// the result. Collective: every rank calls it.
torch::OrderedDict<std::string, at::Tensor> full_state_dict(torch::nn::Module& model,
                                                            const StateDictOptions& options = {});

/// The full optimizer state of `model`'s parameters, keyed by original name:
/// "<name>/momentum_buffer" (SGD), "<name>/exp_avg", "<name>/exp_avg_sq",
/// ["<name>/max_exp_avg_sq"] and "<name>/step" (a 0-d float32 tensor, as
/// PyTorch's Adam keeps it) for Adam and AdamW; "<name>/square_avg",
/// ["<name>/momentum_buffer"], ["<name>/grad_avg"] and the step for RMSprop;
/// "<name>/sum" and the step for Adagrad. Full shapes, whether the optimizer
/// steps flat shards or, with use_orig_params, per-parameter pieces.
/// Parameters without state (never stepped, or not stepped by this
/// optimizer) are absent (Adagrad's, which its
/// constructor makes, are present). Collective.
torch::OrderedDict<std::string, at::Tensor> full_optim_state_dict(
    torch::nn::Module& model, torch::optim::Optimizer& optimizer,
    const StateDictOptions& options = {});

/// Copies a full state dict (as from full_state_dict()) into `model`: each rank
/// takes its shard. Every rank passes the whole dict (or, with
/// broadcast_from_rank0, rank 0 does); collective: the ranks agree that the
/// dict is empty on all of them or on none (rank0_only's dicts are empty on
/// ranks 1..). The names and shapes must match the model's exactly, unless
/// options.strict() is false: then the names the two do not share are
/// returned.
IncompatibleKeys load_full_state_dict(torch::nn::Module& model,
                                      const torch::OrderedDict<std::string, at::Tensor>& state_dict,
                                      const StateDictOptions& options = {});

/// Sets `optimizer`'s state from a full optimizer state dict (as from
/// full_optim_state_dict()); every rank passes the whole dict, or rank 0
/// with broadcast_from_rank0; collective, as load_full_state_dict(). A step
/// may also be an int64 tensor (as libfsdp saved it before 2026-11).
void load_full_optim_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                const torch::OrderedDict<std::string, at::Tensor>& state_dict,
                                const StateDictOptions& options = {});

}  // namespace fsdp
