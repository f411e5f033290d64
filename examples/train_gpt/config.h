#pragma once

// Command line of train_gpt: every setting of a run, parsed and validated once.

#include <cstdint>
#include <optional>
#include <string>

#include <fsdp/state/checkpoint.h>
#include <fsdp/wrap/options.h>

namespace train_gpt {

/// How rank 0 reports progress.
enum class ProgressMode {
  kAuto,  ///< kBar when stdout (or fsdprun's) is a terminal, else kLog.
  kBar,   ///< One progress bar redrawn in place.
  kLog,   ///< A plain line every --log-interval steps.
  kNone,  ///< Nothing but errors and the final summary.
};

/// Where the model trains.
enum class DeviceChoice {
  kAuto,  ///< kCuda where this process sees a GPU, else kCpu.
  kCpu,   ///< The CPU.
  kCuda,  ///< The GPU LOCAL_RANK names (modulo the GPUs visible).
};

/// Every setting of a run. Defaults train a small model in about a minute on
/// two cores (see the README's first command).
struct TrainConfig {
  // Model (gpt_mini::GPTConfig; the vocabulary comes from the corpus).
  int64_t n_layer = 4;
  int64_t d_model = 128;
  int64_t n_head = 4;
  int64_t seq_len = 64;

  // Data.
  std::string data_path;          ///< Empty: the generated default corpus.
  int64_t corpus_chars = 300000;  ///< Size of the generated corpus.
  double val_fraction = 0.1;      ///< Tail of the text held out for evaluation.

  // Optimisation.
  int64_t batch_size = 16;  ///< Global batch (sequences per step, all ranks).
  int64_t steps = 400;
  int64_t warmup_steps = -1;  ///< -1: a tenth of the steps.
  double lr = 3e-3;           ///< Peak learning rate.
  double min_lr = 3e-4;       ///< Learning rate at the end of the cosine.
  double weight_decay = 0.1;  ///< AdamW decay of weights (not biases, LayerNorm).
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;  ///< Max global gradient norm; 0 disables clipping.

  // FSDP.
  fsdp::ShardingStrategy sharding = fsdp::ShardingStrategy::kFullShard;
  bool bf16 = false;  ///< Compute and all-gather in bfloat16; fp32 shards and reduction.
  /// Shards, gradients and AdamW state in host memory, stepped by
  /// fsdp::optim::FusedAdamW (FSDPOptions::cpu_offload).
  bool cpu_offload = false;
  /// With cpu_offload: each unit's host shard stepped as backward hands its
  /// reduced gradient over (FusedAdamW::step_during_backward); no global
  /// gradient norm exists before it, so grad_clip must be 0.
  bool step_during_backward = false;
  DeviceChoice device = DeviceChoice::kAuto;

  // Evaluation and sampling.
  int64_t eval_interval = 100;  ///< Evaluate every N steps (and after the last).
  int64_t eval_batches = 4;     ///< Held-out batches per evaluation.
  int64_t sample_tokens = 300;  ///< Characters generated at the end; 0: none.
  double temperature = 0.8;     ///< 0: greedy.
  std::string prompt = "The ";

  // Checkpoints (see Note [Training state]).
  std::string checkpoint_dir;    ///< Empty: no checkpoints.
  int64_t checkpoint_every = 0;  ///< Save every K steps (and after the last); 0: only the last.
  bool resume = false;           ///< Continue from the latest checkpoint in checkpoint_dir.
  fsdp::StateDictType checkpoint_type = fsdp::StateDictType::kSharded;
  int64_t stop_after = 0;  ///< Stop after this step as if interrupted; 0: run to the end.
  int64_t keep_last = 0;   ///< Keep the newest N checkpoints (fsdp::CheckpointerOptions); 0: all.

  // Output and run time.
  std::string metrics_dir;  ///< Empty: no JSONL files.
  int64_t log_interval = 20;
  ProgressMode progress = ProgressMode::kAuto;
  uint64_t seed = 1337;
  int threads = 1;         ///< Intra-op (and BLAS) threads per rank.
  double timeout_s = 300;  ///< Collective timeout (fsdp::ProcessGroupOptions::timeout).
};

/// Parses argv into a config. Returns the exit code when the program should
/// stop now: 0 after --help, non-zero after an error (already printed to
/// stderr with the usage hint), std::nullopt to go on training.
std::optional<int> parse_command_line(int argc, char** argv, TrainConfig* config);

}  // namespace train_gpt
