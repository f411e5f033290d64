#pragma once

#include <torch/nn/module.h>

#include <vector>

namespace fsdp {

class Unit;

/// While alive, every unit in `root`'s module tree is unsharded, so the
/// original parameters (named_parameters()) hold the full values on every
/// rank. Collective: every rank must create and destroy it together.
/// Writes to the full parameters are not kept (no writeback yet).
class SummonFullParams {
 public:
  /// Gathers every unit under (and including) `root`.
  explicit SummonFullParams(torch::nn::Module& root);
  /// Frees what it gathered.
  ~SummonFullParams();
  SummonFullParams(const SummonFullParams&) = delete;
  SummonFullParams& operator=(const SummonFullParams&) = delete;

 private:
  std::vector<Unit*> gathered_;
};

}  // namespace fsdp
