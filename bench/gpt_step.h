#pragma once

// The GPT that bench_step and bench_gpu_step train: its configuration from
// their shared options (bench::add_gpt_step_options), the model behind one
// forward (plain LibTorch, an FSDP wrapper root, or units made in place),
// and each rank's batch.

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <vector>

#include <fsdp/fsdp.h>

#include "gpt_mini.h"

namespace bench {

/// The GPT of a step benchmark's shape options (vocab, seq, d_model, heads,
/// blocks).
template <typename StepArgs>
gpt_mini::GPTConfig gpt_config(const StepArgs& a) {
  return gpt_mini::GPTConfig()
      .vocab_size(a.vocab)
      .block_size(a.seq)
      .d_model(a.d_model)
      .n_head(a.heads)
      .n_layer(a.blocks);
}

/// The model a step benchmark times, behind one forward. Made once, by one
/// of plain(), wrapped() or in_place(); not moved after.
struct GptUnderTest {
  gpt_mini::GPT local{nullptr};                                        ///< plain, or made in place
  fsdp::FullyShardedDataParallel<gpt_mini::GPTImpl> sharded{nullptr};  ///< wrapped
  std::vector<at::Tensor> params;                                      ///< what the optimizer steps
  fsdp::Unit* root = nullptr;  ///< the FSDP root (wrapped or in place); null when plain

  /// Plain LibTorch on `device`.
  void plain(const gpt_mini::GPTConfig& config, const torch::Device& device) {
    local = gpt_mini::GPT(config);
    local->to(device);
    params = local->parameters();
  }
  /// An FSDP root around a GPT whose blocks are units made with `unit_opts`.
  void wrapped(const gpt_mini::GPTConfig& config, const fsdp::FSDPOptions& unit_opts,
               const fsdp::FSDPOptions& root_opts) {
    sharded = fsdp::FullyShardedDataParallel<gpt_mini::GPTImpl>(
        std::make_shared<gpt_mini::GPTImpl>(config, unit_opts), root_opts);
    params = sharded->parameters();
    root = sharded.ptr().get();
  }
  /// The plain GPT, its blocks and root made units by fsdp::fully_shard.
  void in_place(const gpt_mini::GPTConfig& config, const fsdp::FSDPOptions& opts) {
    local = gpt_mini::GPT(config);
    root = &fsdp::fully_shard(local, fsdp::module_type_policy<gpt_mini::BlockImpl>(), opts);
    params = root->flat_parameters();
  }
  /// The logits of `tokens`.
  at::Tensor forward(const at::Tensor& tokens) {
    return sharded ? sharded->forward(tokens) : local->forward(tokens);
  }
};

/// Rank `rank`'s batch (seed 1000 + rank: rank 0's is the local run's, so
/// the first loss agrees between modes), on `device`.
struct TokenBatch {
  at::Tensor inputs;   ///< [batch, seq] token ids
  at::Tensor targets;  ///< the next token of each
};
template <typename StepArgs>
TokenBatch rank_batch(const StepArgs& a, int rank, const torch::Device& device) {
  torch::manual_seed(1000 + rank);
  const at::Tensor data = torch::randint(a.vocab, {a.batch, a.seq + 1}, torch::kLong);
  return {data.slice(1, 0, a.seq).contiguous().to(device),
          data.slice(1, 1, a.seq + 1).contiguous().to(device)};
}

}  // namespace bench
