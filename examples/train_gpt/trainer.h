#pragma once

// The model, the optimizer and what one rank does with them: a training
// step, a held-out evaluation, and text generation. Every method is
// collective: all ranks call it together, in the same order.

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "batches.h"
#include "config.h"
#include "corpus.h"
#include "gpt_mini.h"

namespace train_gpt {

/// The sharded model: an FSDP root around a GPT whose blocks are units.
using ShardedGPT = fsdp::FullyShardedDataParallel<gpt_mini::GPTImpl>;

/// What one training step produced (the same on every rank unless noted).
struct StepResult {
  double loss = 0;        ///< Mean loss over all ranks' rows.
  double local_loss = 0;  ///< This rank's rows only.
  /// Global gradient norm before clipping; none when the optimizer stepped
  /// during backward (no norm exists before it).
  std::optional<double> grad_norm;
  std::vector<int64_t> current_bytes;  ///< Tracked memory of each rank after the step.
  std::vector<int64_t> peak_bytes;     ///< Peak tracked memory of each rank so far.
};

/// One rank's share of the model and optimizer, and the collectives around them.
class Trainer {
 public:
  /// Builds the model on `device` (the same initial weights on every rank,
  /// from config.seed) and AdamW with two parameter groups.
  Trainer(const TrainConfig& config, const Corpus& corpus, std::shared_ptr<fsdp::ProcessGroup> pg,
          torch::Device device);

  /// Forward, backward, gradient clipping and an optimizer step at rate `lr`.
  StepResult train_step(const Batch& batch, double lr);

  /// True when every rank's shards hold only finite values (collective): a
  /// diverged step can leave NaN in the parameters while its loss, computed
  /// before the update, was finite.
  bool parameters_finite();

  /// Mean loss on the held-out batches (each rank evaluates its rows).
  double evaluate(const std::vector<Batch>& batches);

  /// `prompt` followed by `n` generated characters. Every rank runs the
  /// forward passes (they are collective); rank 0 draws each character and
  /// broadcasts it. temperature 0 is greedy.
  std::string generate(const std::string& prompt, int64_t n, double temperature, uint64_t seed);

  /// Parameters with and without weight decay (for the log).
  int64_t decayed_params() const { return decayed_; }
  int64_t undecayed_params() const { return undecayed_; }
  /// Elements of the full (unsharded) model.
  int64_t total_params() const { return total_params_; }

  /// The device the model trains on.
  torch::Device device() const { return device_; }

  /// The model and optimizer (what a checkpoint saves next to TrainState).
  ShardedGPT& model() { return model_; }
  torch::optim::AdamW& optimizer() { return *optimizer_; }
  /// Which AdamW steps the shards, and when ("fsdp::optim::FusedAdamW,
  /// stepping during backward"), as the optimizer itself reports it.
  std::string optimizer_name() const;

 private:
  void build_optimizer();

  const TrainConfig config_;
  const Corpus& corpus_;
  std::shared_ptr<fsdp::ProcessGroup> pg_;
  const torch::Device device_;
  ShardedGPT model_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  int64_t decayed_ = 0;
  int64_t undecayed_ = 0;
  int64_t total_params_ = 0;
};

}  // namespace train_gpt
