#pragma once

// GPT-mini: a small decoder-only transformer (token + position embeddings,
// pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, final
// LayerNorm, a linear head), written with plain LibTorch ops so that it needs
// nothing beyond LibTorch 1.13. Shared by examples/train_gpt, bench/bench_step.cpp
// and tests/core/test_transformer_parity.cpp (CMake target fsdp_models).
//
// Each block can be its own FSDP unit: GPT(config, block_options) wraps every
// block in fsdp::FullyShardedDataParallel<BlockImpl> while the model is built;
// GPT(config) builds the same model with plain blocks (the local baseline).
// Seeded identically (torch::manual_seed), both draw the same initial values.

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/wrap/fully_sharded.h>
#include <fsdp/wrap/options.h>

namespace gpt_mini {

/// Shape of a GPT-mini model.
struct GPTConfig {
  /// Number of distinct tokens.
  TORCH_ARG(int64_t, vocab_size) = 256;
  /// Longest sequence (size of the position embedding and the causal mask).
  TORCH_ARG(int64_t, block_size) = 128;
  /// Width of the residual stream.
  TORCH_ARG(int64_t, d_model) = 512;
  /// Attention heads (d_model must be a multiple of it).
  TORCH_ARG(int64_t, n_head) = 8;
  /// Transformer blocks.
  TORCH_ARG(int64_t, n_layer) = 8;
  /// Recompute each block's activations in backward instead of keeping them
  /// (fsdp::CheckpointWrapper around plain blocks; the units' own
  /// activation_checkpointing option for sharded ones).
  TORCH_ARG(bool, activation_checkpointing) = false;
  /// With block options, the output head is a unit of its own (as torchtitan
  /// shards it) instead of the root's: its gradient, the first backward
  /// makes, is reduced (and under CPU offload stepped on the host) while
  /// backward goes on, not with the embeddings' at its end.
  TORCH_ARG(bool, head_unit) = false;
};

namespace detail {
// GPT-2's initialisation: N(0, 0.02) weights, zero biases; `std` lets the
// residual projections use the smaller scale GPT-2 gives them, so the
// residual stream does not grow with depth.
inline void init_linear(torch::nn::Linear& fc, double std = 0.02) {
  torch::NoGradGuard no_grad;
  fc->weight.normal_(0.0, std);
  if (fc->bias.defined()) fc->bias.zero_();
}
}  // namespace detail

/// Multi-head causal self-attention from plain ops (a fused qkv projection,
/// matmuls, a causal mask and softmax), independent of nn::MultiheadAttention.
class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  /// Builds the projections and the [block_size, block_size] causal mask.
  explicit CausalSelfAttentionImpl(const GPTConfig& config)
      : n_head_(config.n_head()), d_model_(config.d_model()) {
    TORCH_CHECK(d_model_ % n_head_ == 0, "gpt_mini: d_model ", d_model_,
                " is not a multiple of n_head ", n_head_);
    qkv_ = register_module("qkv", torch::nn::Linear(d_model_, 3 * d_model_));
    proj_ = register_module("proj", torch::nn::Linear(d_model_, d_model_));
    detail::init_linear(qkv_);
    detail::init_linear(proj_, 0.02 / std::sqrt(2.0 * static_cast<double>(config.n_layer())));
    // True above the diagonal: the future positions a query may not see. A
    // buffer, so it follows the module (and FSDP's wrapper re-registers it).
    future_ = register_buffer(
        "future", torch::ones({config.block_size(), config.block_size()}, torch::kBool).triu(1));
  }

  /// x: [batch, time, d_model] -> [batch, time, d_model].
  at::Tensor forward(at::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1);
    const int64_t hd = d_model_ / n_head_;
    auto qkv = qkv_->forward(x).split(d_model_, /*dim=*/2);
    // [b, t, d] -> [b, heads, t, head_dim]
    auto q = qkv[0].view({b, t, n_head_, hd}).transpose(1, 2);
    auto k = qkv[1].view({b, t, n_head_, hd}).transpose(1, 2);
    auto v = qkv[2].view({b, t, n_head_, hd}).transpose(1, 2);
    auto att = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
    att = att.masked_fill(future_.slice(0, 0, t).slice(1, 0, t),
                          -std::numeric_limits<float>::infinity());
    att = at::softmax(att, -1);
    auto y = at::matmul(att, v).transpose(1, 2).contiguous().view({b, t, d_model_});
    return proj_->forward(y);
  }

 private:
  int64_t n_head_;
  int64_t d_model_;
  torch::nn::Linear qkv_{nullptr};
  torch::nn::Linear proj_{nullptr};
  at::Tensor future_;
};
TORCH_MODULE(CausalSelfAttention);

/// One transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)), with a
/// 4x-wide GELU MLP. The granularity of an FSDP unit in GPT.
class BlockImpl : public torch::nn::Module {
 public:
  /// Builds the block's layers (drawing their initial values now).
  explicit BlockImpl(const GPTConfig& config) {
    const int64_t d = config.d_model();
    ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    attn_ = register_module("attn", CausalSelfAttention(config));
    ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc_ = register_module("fc", torch::nn::Linear(d, 4 * d));
    proj_ = register_module("proj", torch::nn::Linear(4 * d, d));
    detail::init_linear(fc_);
    detail::init_linear(proj_, 0.02 / std::sqrt(2.0 * static_cast<double>(config.n_layer())));
  }

  /// x: [batch, time, d_model] -> [batch, time, d_model].
  at::Tensor forward(at::Tensor x) {
    x = x + attn_->forward(ln1_->forward(x));
    // GPT-2's tanh approximation of GELU.
    return x + proj_->forward(at::gelu(fc_->forward(ln2_->forward(x)), "tanh"));
  }

 private:
  torch::nn::LayerNorm ln1_{nullptr};
  CausalSelfAttention attn_{nullptr};
  torch::nn::LayerNorm ln2_{nullptr};
  torch::nn::Linear fc_{nullptr};
  torch::nn::Linear proj_{nullptr};
};
TORCH_MODULE(Block);

/// Elements of one block's parameters (what one block's all-gather brings in).
inline int64_t block_param_count(const GPTConfig& config) {
  const int64_t d = config.d_model();
  // qkv (3d^2 + 3d), attention proj (d^2 + d), fc (4d^2 + 4d), mlp proj
  // (4d^2 + d), two LayerNorms (4d).
  return 12 * d * d + 13 * d;
}

/// The whole model: tokens [batch, time] (int64) -> logits [batch, time, vocab].
class GPTImpl : public torch::nn::Module {
 public:
  /// Builds the model; with `block_options`, each block becomes an FSDP unit
  /// (wrapped right after it is built, so initial values match GPT(config)).
  explicit GPTImpl(const GPTConfig& config,
                   std::optional<fsdp::FSDPOptions> block_options = std::nullopt)
      : config_(config) {
    const int64_t d = config.d_model();
    tok_emb_ = register_module("tok_emb", torch::nn::Embedding(config.vocab_size(), d));
    pos_emb_ = register_module("pos_emb", torch::nn::Embedding(config.block_size(), d));
    {
      torch::NoGradGuard no_grad;
      tok_emb_->weight.normal_(0.0, 0.02);
      pos_emb_->weight.normal_(0.0, 0.02);
    }
    for (int64_t i = 0; i < config.n_layer(); ++i) {
      const std::string name = "h" + std::to_string(i);
      Block block(config);
      if (block_options) {
        // Built on the CPU (so initial values match GPT(config) on any
        // device), then moved to the units' device before it is wrapped.
        if (block_options->device_id()) block->to(*block_options->device_id());
        fsdp::FSDPOptions unit_options = *block_options;
        if (config.activation_checkpointing()) unit_options.activation_checkpointing(true);
        fsdp::FullyShardedDataParallel<BlockImpl> unit(block, unit_options);
        register_module(name, unit);
        // AnyModule works for all: the wrappers' forward has Block's signature.
        blocks_.emplace_back(unit);
      } else if (config.activation_checkpointing()) {
        fsdp::CheckpointWrapper<BlockImpl> checkpointed(block);
        register_module(name, checkpointed);
        blocks_.emplace_back(checkpointed);
      } else {
        register_module(name, block);
        blocks_.emplace_back(block);
      }
    }
    ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    head_ = torch::nn::Linear(torch::nn::LinearOptions(d, config.vocab_size()).bias(false));
    detail::init_linear(head_);
    const bool head_unit = block_options && config.head_unit();
    if (head_unit) {
      if (block_options->device_id()) head_->to(*block_options->device_id());
      head_unit_ = register_module(
          "head", fsdp::FullyShardedDataParallel<torch::nn::LinearImpl>(head_, *block_options));
    } else {
      register_module("head", head_);
    }
    if (block_options && block_options->device_id()) {
      // The root unit's own parameters join the blocks on their device.
      const torch::Device device = *block_options->device_id();
      tok_emb_->to(device);
      pos_emb_->to(device);
      ln_f_->to(device);
      if (!head_unit) head_->to(device);
    }
  }

  /// tokens: [batch, time] int64 with time <= block_size -> logits [batch, time, vocab].
  at::Tensor forward(at::Tensor tokens) {
    const int64_t t = tokens.size(1);
    TORCH_CHECK(t <= config_.block_size(), "gpt_mini: sequence of ", t,
                " tokens is longer than block_size ", config_.block_size());
    auto pos = at::arange(t, tokens.options().dtype(at::kLong));
    at::Tensor x = tok_emb_->forward(tokens) + pos_emb_->forward(pos);
    for (auto& block : blocks_) x = block.forward(x);
    x = ln_f_->forward(x);
    return head_unit_ ? head_unit_->forward(x) : head_->forward(x);
  }

  /// The configuration the model was built with.
  const GPTConfig& config() const { return config_; }

 private:
  GPTConfig config_;
  torch::nn::Embedding tok_emb_{nullptr};
  torch::nn::Embedding pos_emb_{nullptr};
  std::vector<torch::nn::AnyModule> blocks_;
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
  fsdp::FullyShardedDataParallel<torch::nn::LinearImpl> head_unit_{
      nullptr};  // GPTConfig::head_unit
};
TORCH_MODULE(GPT);

/// Next-token cross-entropy of `logits` [batch, time, vocab] against `targets`
/// [batch, time], in fp32 whatever the logits' dtype (bf16 under mixed precision).
inline at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                              targets.reshape({-1}));
}

}  // namespace gpt_mini
