#pragma once

// Full tensors of a sharded model and its optimizer, one unit at a time.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <string>
#include <vector>

namespace fsdp::detail {

/// One full tensor: "model/<name>", "optim/<name>/<state>" or "optim/<name>/step".
struct FullSpec {
  std::string key;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  /// Another name of the tensor before (Note [Tied parameters]).
  bool alias = false;
};

/// Walks the full tensors of `root` (and of `opt` when given) in a fixed
/// order: per unit (pre-order) its parameters, then each optimizer state of
/// its parameters, then their steps; then parameters no unit shards; then
/// buffers. Which optimizer states exist is agreed over the group when the
/// walker is built (one all-reduce), so every rank walks the same specs.
class FullWalker {
 public:
  /// Collective when `opt` is given. `aliases`: a tied parameter's full
  /// tensor comes again under each of its other names (full state dicts;
  /// Note [Tied parameters]).
  FullWalker(torch::nn::Module& root, torch::optim::Optimizer* opt, bool model,
             bool aliases = false);
  /// The tensors walk() produces, in its order.
  const std::vector<FullSpec>& specs() const { return specs_; }
  /// Gathers each full tensor (collective per unit) and calls fn with its
  /// index in specs() and the tensor, valid during the call only. Only one
  /// unit is gathered at a time.
  void walk(const std::function<void(size_t, const at::Tensor&)>& fn);

 private:
  void run(const std::function<void(size_t, const at::Tensor&)>* fn);

  torch::nn::Module& root_;
  torch::optim::Optimizer* opt_;
  bool model_;
  bool aliases_;
  std::vector<int64_t> agreed_;  // per optimizer parameter piece: (has state, step)
  std::vector<FullSpec> specs_;
};

}  // namespace fsdp::detail
