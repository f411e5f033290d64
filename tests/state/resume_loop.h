#pragma once

// A training loop that checkpoints and resumes: inputs come from each rank's
// global generator (seeded differently per rank), targets from a registered
// data position, so an exact resume needs the model, the optimizer, the RNG
// state and the registered state.

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>

#include <fsdp/fsdp.h>

#include "test_models.h"

namespace fsdp::testing {

/// How resume_loop trains.
enum class ResumeModel {
  kPlain,  ///< fp32 units, torch::optim::AdamW
  /// Offloaded bf16 units; FusedAdamW writing their bf16 host copies,
  /// stepping during backward.
  kOffloadedBf16,
};

/// Runs steps [resumed, steps) (resuming from the latest checkpoint under
/// `parent` if any), saving every `save_every` steps; `on_step(step)` runs
/// after each step (before its save). Saves the final state fully to `final_dir`.
inline void resume_loop(const std::string& parent, int64_t steps, int64_t save_every,
                        const std::string& final_dir,
                        const std::function<void(int64_t)>& on_step = {},
                        ResumeModel kind = ResumeModel::kPlain) {
  const int rank = default_process_group()->rank();
  auto o = FSDPOptions().sharding_strategy(ShardingStrategy::kFullShard);
  if (kind == ResumeModel::kOffloadedBf16) {
    o.cpu_offload(CPUOffload().offload_params(true))
        .mixed_precision(MixedPrecision().param_dtype(at::kBFloat16));
  }
  torch::manual_seed(0);
  FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, o), o);
  std::unique_ptr<torch::optim::AdamW> optimizer;
  if (kind == ResumeModel::kOffloadedBf16) {
    auto fused =
        std::make_unique<optim::FusedAdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
    fused->write_compute_copies(*model);
    fused->step_during_backward(*model);
    optimizer = std::move(fused);
  } else {
    optimizer = std::make_unique<torch::optim::AdamW>(model->parameters(),
                                                      torch::optim::AdamWOptions(1e-2));
  }
  torch::optim::AdamW& opt = *optimizer;
  torch::manual_seed(1000 + rank);  // per-rank data
  int64_t position = 0;             // the "data loader"
  Checkpointer ckpt(*model, &opt);
  ckpt.register_state(
      "data_position", [&] { return std::to_string(position); },
      [&](const std::string& s) { position = std::stoll(s); });
  int64_t step = ckpt.resume(parent);
  if (step < 0) step = 0;
  for (; step < steps; ++step) {
    torch::Tensor x = torch::randn({4, 7});
    torch::Tensor y = torch::full({4, 3}, static_cast<double>(position % 5));
    position += 4;
    opt.zero_grad();
    torch::mse_loss(model->forward(x).to(at::kFloat), y).backward();
    opt.step();
    if (on_step) on_step(step + 1);
    if ((step + 1) % save_every == 0) ckpt.save_step(parent, step + 1);
  }
  ckpt.save(final_dir, steps, StateDictType::kFull);
}

}  // namespace fsdp::testing
