"""GPT-mini in PyTorch: a mirror of examples/models/gpt_mini.h.

Same modules under the same names, so that ``model.state_dict()`` has exactly
the keys libfsdp's full checkpoint uses (its original parameter and buffer
names: ``tok_emb.weight``, ``h0.attn.qkv.weight``, ``h0.attn.future``, ...),
and the same math: token + position embeddings, pre-LayerNorm blocks of
causal self-attention (fused qkv, explicit mask and softmax) and a 4x MLP
with GELU's tanh approximation, a final LayerNorm and a bias-free head.

The blocks are attributes ``h0``, ``h1``, ... of the model (as in the C++
``register_module("h" + i, ...)``), not a ModuleList, which would add a
prefix to their names. ``GPT.blocks()`` lists them (FSDP's wrap policy takes
``Block``). Used by tests/interop and bench/pytorch_step.py.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """Shape of a GPT-mini model (the C++ GPTConfig's defaults)."""

    vocab_size: int = 256
    block_size: int = 128
    d_model: int = 512
    n_head: int = 8
    n_layer: int = 8


def _init_linear(fc: nn.Linear, std: float = 0.02) -> None:
    # GPT-2's initialisation, as gpt_mini::detail::init_linear.
    with torch.no_grad():
        fc.weight.normal_(0.0, std)
        if fc.bias is not None:
            fc.bias.zero_()


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention from plain ops."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.d_model % config.n_head != 0:
            raise ValueError(
                f"gpt_mini: d_model {config.d_model} is not a multiple of n_head {config.n_head}")
        self.n_head = config.n_head
        self.d_model = config.d_model
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        _init_linear(self.qkv)
        _init_linear(self.proj, 0.02 / math.sqrt(2.0 * config.n_layer))
        # True above the diagonal; a persistent buffer as in C++ (libfsdp saves it).
        self.register_buffer(
            "future", torch.ones(config.block_size, config.block_size, dtype=torch.bool).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.d_model // self.n_head
        q, k, v = self.qkv(x).split(self.d_model, dim=2)
        q = q.view(b, t, self.n_head, hd).transpose(1, 2)
        k = k.view(b, t, self.n_head, hd).transpose(1, 2)
        v = v.view(b, t, self.n_head, hd).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(self.future[:t, :t], float("-inf"))
        att = torch.softmax(att, -1)
        y = torch.matmul(att, v).transpose(1, 2).contiguous().view(b, t, self.d_model)
        return self.proj(y)


class Block(nn.Module):
    """x + attn(ln1(x)), then x + mlp(ln2(x)); an FSDP unit."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.d_model
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        _init_linear(self.fc)
        _init_linear(self.proj, 0.02 / math.sqrt(2.0 * config.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """tokens [batch, time] (int64) -> logits [batch, time, vocab]."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        d = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, d)
        self.pos_emb = nn.Embedding(config.block_size, d)
        with torch.no_grad():
            self.tok_emb.weight.normal_(0.0, 0.02)
            self.pos_emb.weight.normal_(0.0, 0.02)
        for i in range(config.n_layer):
            self.add_module(f"h{i}", Block(config))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, config.vocab_size, bias=False)
        _init_linear(self.head)

    def blocks(self):
        """The blocks h0, h1, ... in order."""
        return [getattr(self, f"h{i}") for i in range(self.config.n_layer)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.size(1)
        if t > self.config.block_size:
            raise ValueError(
                f"gpt_mini: sequence of {t} tokens is longer than block_size "
                f"{self.config.block_size}")
        pos = torch.arange(t, dtype=torch.long, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks():
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32 (gpt_mini::lm_loss)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
