#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>

#include <vector>

namespace fsdp {

class Unit;

/// Options of SummonFullParams.
struct SummonOptions {
  /// Copy each rank's part of the (possibly modified) full parameters back
  /// into its shard when the guard ends.
  TORCH_ARG(bool, writeback) = false;
  /// Only rank 0 keeps the full parameters; the others free them at once
  /// (they still take part in the all-gathers). Not allowed with writeback.
  TORCH_ARG(bool, rank0_only) = false;
  /// The full parameters of units that shard on a GPU are held in host
  /// memory, gathered one unit at a time, so the GPU never holds more than
  /// one unit's full parameters besides what training keeps (FSDP1's
  /// offload_to_cpu; best with rank0_only). Nothing changes on the CPU.
  TORCH_ARG(bool, offload_to_cpu) = false;
  /// Each original parameter's .grad holds its full gradient too, where
  /// some rank's shard has one (FSDP1's with_grads; here also without
  /// use_orig_params and with offload_to_cpu); with writeback, changes to
  /// them go back into the shards' gradients.
  TORCH_ARG(bool, with_grads) = false;
};

/// While alive, every unit in `root`'s module tree is unsharded, so the
/// original parameters (named_parameters()) hold the full values on every
/// rank (rank 0 only with rank0_only), in full precision under mixed
/// precision (as PyTorch's FSDP1). Forward and backward through its units
/// are errors while it lives; a guard nested in it leaves the units it
/// already holds as they are (FSDP's nested summon_full_params).
/// Collective: every rank must create and destroy it together. Inside it,
/// torch::save(model, path) communicates nothing, so rank 0 alone may call
/// it (PyTorch's habit; see Note [Saving a unit]).
class SummonFullParams {
 public:
  /// Gathers every unit under (and including) `root`.
  explicit SummonFullParams(torch::nn::Module& root, SummonOptions options = {});
  /// Writes back (if asked) and frees what it gathered.
  ~SummonFullParams();
  SummonFullParams(const SummonFullParams&) = delete;
  SummonFullParams& operator=(const SummonFullParams&) = delete;

 private:
  SummonOptions options_;
  std::vector<Unit*> units_;     // the units with parameters it holds, pre-order
  std::vector<Unit*> gathered_;  // those this guard unsharded
};

}  // namespace fsdp
