#include "config.h"

#include <CLI/CLI.hpp>

#include <cmath>
#include <iostream>
#include <map>
#include <vector>

namespace train_gpt {
namespace {

// CLI11's Range and NonNegativeNumber let NaN through (every comparison with
// it is false), and NonNegativeNumber lets infinity through: every numeric
// flag checks this first. A value that is not a number at all is left to the
// option's own conversion, which names it.
const CLI::Validator kFinite(
    [](std::string& text) {
      double v = 0;
      if (!CLI::detail::lexical_cast(text, v) || std::isfinite(v)) return std::string();
      return "expected a finite number, got " + text;
    },
    "");

// An option that names one of `choices`, and where its choice goes once
// parsed (see add_choice).
template <typename E>
struct Choice {
  std::string name;
  std::map<std::string, E> values;
};

// CLI11 shows a mapped enum's values in --help and in its errors, as raw
// bytes for a uint8_t enum (ShardingStrategy): the option holds the name
// instead, checked against the names, and the caller maps it after parsing.
template <typename E>
CLI::Option* add_choice(CLI::App& app, const char* flag, Choice<E>& choice, const char* help,
                        const char* group) {
  std::vector<std::string> names;
  for (const auto& kv : choice.values) names.push_back(kv.first);
  return app.add_option(flag, choice.name, help)
      ->check(CLI::IsMember(names, CLI::ignore_case))
      ->group(group)
      ->capture_default_str();
}

// Checks that involve several flags; CLI11's validators see one value each.
void check_combinations(TrainConfig& c) {
  if (c.d_model % c.n_head != 0) {
    throw CLI::ValidationError(
        "--d-model", "--d-model " + std::to_string(c.d_model) + " is not a multiple of --heads " +
                         std::to_string(c.n_head) + "; pick a width divisible by the head count");
  }
  if (c.warmup_steps < 0) c.warmup_steps = c.steps / 10;
  if (c.warmup_steps > c.steps) {
    throw CLI::ValidationError("--warmup-steps", "--warmup-steps " +
                                                     std::to_string(c.warmup_steps) +
                                                     " exceeds --steps " + std::to_string(c.steps));
  }
  if (c.min_lr > c.lr) {
    throw CLI::ValidationError("--min-lr", "--min-lr must not exceed --lr");
  }
  if (c.checkpoint_dir.empty()) {
    for (const auto& [flag, given] : {std::pair<const char*, bool>{"--resume", c.resume},
                                      {"--checkpoint-every", c.checkpoint_every > 0},
                                      {"--keep-last", c.keep_last > 0}}) {
      if (given) {
        throw CLI::ValidationError(flag, std::string(flag) +
                                             " needs --checkpoint-dir DIR (where checkpoints "
                                             "are written and looked for)");
      }
    }
  }
  if (c.step_during_backward && !c.cpu_offload) {
    throw CLI::ValidationError("--step-during-backward",
                               "--step-during-backward steps the host shards of --cpu-offload; "
                               "pass --cpu-offload with it");
  }
  if (c.step_during_backward && c.grad_clip > 0) {
    throw CLI::ValidationError(
        "--step-during-backward",
        "--step-during-backward steps each unit before backward has made the others' "
        "gradients, so no global norm exists to clip by: pass --grad-clip 0 with it");
  }
  if (c.stop_after > c.steps) {
    throw CLI::ValidationError("--stop-after", "--stop-after " + std::to_string(c.stop_after) +
                                                   " exceeds --steps " + std::to_string(c.steps));
  }
}

}  // namespace

std::optional<int> parse_command_line(int argc, char** argv, TrainConfig* config) {
  TrainConfig& c = *config;
  CLI::App app(
      "Trains a character-level GPT with libfsdp (each transformer block an FSDP unit).\n"
      "Run it with fsdprun, e.g.: fsdprun --nproc-per-node 2 train_gpt --steps 400",
      "train_gpt");
  app.get_formatter()->column_width(44);
  // A flag given twice: the last one counts (so scripts can override defaults).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);

  // name, variable, help, check, group; the default shows in --help.
  auto add = [&app](const char* name, auto& value, const char* help, const CLI::Validator& check,
                    const char* group) {
    return app.add_option(name, value, help)
        ->check(kFinite)
        ->check(check)
        ->group(group)
        ->capture_default_str();
  };
  const auto count = [](int64_t lo) { return CLI::Range(lo, int64_t{1} << 40); };

  const char* model = "Model";
  add("--layers", c.n_layer, "Transformer blocks (each an FSDP unit)", CLI::Range(1, 1024), model);
  add("--d-model", c.d_model, "Width of the residual stream", CLI::Range(1, 1 << 16), model);
  add("--heads", c.n_head, "Attention heads (must divide --d-model)", CLI::Range(1, 1024), model);
  add("--seq-len", c.seq_len, "Characters per training sequence (context length)",
      CLI::Range(1, 1 << 16), model);

  const char* data = "Data";
  app.add_option("--data", c.data_path,
                 "Text file to train on (default: a generated English-like corpus)")
      ->check(CLI::ExistingFile)
      ->group(data);
  add("--corpus-chars", c.corpus_chars, "Size of the generated default corpus",
      CLI::Range(1000, 1 << 28), data);
  add("--val-fraction", c.val_fraction, "Tail of the text held out for evaluation",
      CLI::Range(0.01, 0.5), data);

  const char* optim = "Optimisation";
  add("--batch-size", c.batch_size, "Global batch in sequences, split evenly over the ranks",
      count(1), optim);
  add("--steps", c.steps, "Optimizer steps", count(1), optim);
  app.add_option("--warmup-steps", c.warmup_steps,
                 "Linear warm-up steps before the cosine decay (default: steps / 10)")
      ->check(kFinite)
      ->check(CLI::NonNegativeNumber)
      ->group(optim);
  add("--lr", c.lr, "Peak learning rate", CLI::Range(1e-12, 10.0), optim);
  add("--min-lr", c.min_lr, "Learning rate at the end of the cosine decay", CLI::Range(0.0, 10.0),
      optim);
  add("--weight-decay", c.weight_decay, "AdamW weight decay (not on biases and LayerNorm)",
      CLI::Range(0.0, 10.0), optim);
  add("--beta1", c.beta1, "AdamW beta1", CLI::Range(0.0, 0.999999), optim);
  add("--beta2", c.beta2, "AdamW beta2", CLI::Range(0.0, 0.999999), optim);
  add("--grad-clip", c.grad_clip, "Max global gradient norm (0: no clipping)",
      CLI::NonNegativeNumber, optim);

  Choice<fsdp::ShardingStrategy> sharding{
      "full_shard",
      {{"full_shard", fsdp::ShardingStrategy::kFullShard},
       {"shard_grad_op", fsdp::ShardingStrategy::kShardGradOp},
       {"no_shard", fsdp::ShardingStrategy::kNoShard},
       {"hybrid_shard", fsdp::ShardingStrategy::kHybridShard},
       {"hybrid_shard_zero2", fsdp::ShardingStrategy::kHybridShardZero2}}};
  add_choice(app, "--sharding", sharding, "FSDP sharding strategy", "FSDP");
  Choice<DeviceChoice> device{
      "auto",
      {{"auto", DeviceChoice::kAuto}, {"cpu", DeviceChoice::kCpu}, {"cuda", DeviceChoice::kCuda}}};
  add_choice(app, "--device", device,
             "Where the model trains: cuda (LOCAL_RANK's GPU), cpu, or auto (cuda where a GPU "
             "is visible, else cpu)",
             "FSDP");
  app.add_flag("--bf16", c.bf16,
               "bfloat16 mixed precision: compute and all-gather in bf16, keep fp32 shards "
               "for AdamW and reduce gradients in fp32")
      ->group("FSDP");
  app.add_flag("--cpu-offload", c.cpu_offload,
               "CPU offload: fp32 shards, gradients and AdamW state in host memory (pinned for a "
               "GPU), stepped by libfsdp's fused host AdamW, which with --bf16 also writes the "
               "bf16 copies sent to the GPU")
      ->group("FSDP");
  app.add_flag("--step-during-backward", c.step_during_backward,
               "With --cpu-offload: step each unit's host shard as soon as backward has reduced "
               "its gradient, beside the rest of backward (needs --grad-clip 0; no gradient "
               "norm is reported)")
      ->group("FSDP");

  const char* ckpt = "Checkpoints";
  app.add_option("--checkpoint-dir", c.checkpoint_dir,
                 "Directory of checkpoints (step-<N> subdirectories), created if missing")
      ->group(ckpt);
  add("--checkpoint-every", c.checkpoint_every,
      "Save a checkpoint every K steps and after the last (0: only after the last)", count(0),
      ckpt);
  app.add_flag("--resume", c.resume,
               "Continue from the latest complete checkpoint in --checkpoint-dir (start from "
               "step 0 when there is none, so a restarted job can always pass it)")
      ->group(ckpt);
  Choice<fsdp::StateDictType> type{
      "sharded",
      {{"sharded", fsdp::StateDictType::kSharded}, {"full", fsdp::StateDictType::kFull}}};
  add_choice(app, "--checkpoint-type", type,
             "sharded: each rank writes its shards; full: rank 0 writes whole tensors "
             "(one safetensors file any reader opens)",
             ckpt);
  add("--keep-last", c.keep_last,
      "Keep only the newest N checkpoints, removing older ones after each save (never the "
      "one resumed from; 0: keep all)",
      count(0), ckpt);
  add("--stop-after", c.stop_after,
      "Stop after this step as if the job were interrupted (0: run all --steps); the learning-"
      "rate schedule still spans --steps, so a later --resume continues the same run",
      count(0), ckpt);

  const char* eval = "Evaluation and sampling";
  add("--eval-interval", c.eval_interval, "Held-out loss every N steps (and after the last)",
      count(1), eval);
  add("--eval-batches", c.eval_batches, "Held-out batches per evaluation", count(1), eval);
  add("--sample-tokens", c.sample_tokens, "Characters generated at the end (0: none)", count(0),
      eval);
  add("--temperature", c.temperature, "Sampling temperature (0: greedy)", CLI::Range(0.0, 100.0),
      eval);
  app.add_option("--prompt", c.prompt, "Text the sample starts from")
      ->group(eval)
      ->capture_default_str();

  const char* out = "Output";
  app.add_option("--metrics-dir", c.metrics_dir,
                 "Directory for per-rank metrics (rank<R>.jsonl), created if missing")
      ->group(out);
  add("--log-interval", c.log_interval, "Steps between log lines (when not a bar)", count(1), out);
  Choice<ProgressMode> progress{"auto",
                                {{"auto", ProgressMode::kAuto},
                                 {"bar", ProgressMode::kBar},
                                 {"log", ProgressMode::kLog},
                                 {"none", ProgressMode::kNone}}};
  add_choice(app, "--progress", progress,
             "auto: a bar on a terminal, log lines otherwise; bar; log; none", out);
  app.add_option("--seed", c.seed, "Seed of the initial weights, the batches and the sample")
      ->group(out)
      ->capture_default_str();
  add("--threads", c.threads, "Intra-op threads per rank", CLI::Range(1, 1024), out);
  add("--timeout", c.timeout_s,
      "Seconds a collective may wait for the other ranks before the run fails (a stopped or "
      "lost rank)",
      CLI::Range(1e-3, 1e7), out);

  try {
    app.parse(argc, argv);
    c.sharding = sharding.values.at(sharding.name);
    c.checkpoint_type = type.values.at(type.name);
    c.progress = progress.values.at(progress.name);
    c.device = device.values.at(device.name);
    check_combinations(c);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints --help to stdout (exit 0) and errors to stderr, the latter
    // followed by a pointer to --help.
    return app.exit(e);
  }
  return std::nullopt;
}

}  // namespace train_gpt
