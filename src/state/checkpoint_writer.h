#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp::detail {

/// What one rank saves besides tensors.
struct SaveRequest {
  std::string dir;
  bool full = false;
  int64_t step = 0;
  std::string rng_state;
  std::vector<std::string> cuda_rng_states;
  std::map<std::string, std::string> extra;
  std::vector<std::map<std::string, double>> param_groups;  ///< the optimizer's options
};

/// Writes a checkpoint directory (collective). See Note [Checkpoint directory].
void write_checkpoint(torch::nn::Module& root, torch::optim::Optimizer* opt,
                      const SaveRequest& request);

}  // namespace fsdp::detail
