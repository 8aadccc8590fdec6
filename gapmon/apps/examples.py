"""A small GPT-style language model and synthetic data, for the demo, tests and benchmarks."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    norm: str = "rms"  # "rms" (nn.RMSNorm) or "layer" (nn.LayerNorm)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _norm(cfg: GPTConfig) -> nn.Module:
    return nn.RMSNorm(cfg.d_model) if cfg.norm == "rms" else nn.LayerNorm(cfg.d_model)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = _norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = _norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Token + position embeddings, pre-norm transformer blocks, final norm, untied LM head."""

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = _norm(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        # Positions are looked up per sample ([B, T] ids), so every module output is batch-first.
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device).expand(b, t))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy; reduction "mean" averages over samples (each sample's mean over tokens).

    On flattened [B·T, V] logits: PyTorch's fast softmax kernels. Transposed [B, V, T] logits take
    the spatial-softmax path, which on a GPU costs more than the rest of a GPT-2-small step."""
    b, t, v = logits.shape
    per_sample = F.cross_entropy(logits.reshape(b * t, v), targets.reshape(b * t), reduction="none").view(b, t).mean(1)
    return per_sample.mean() if reduction == "mean" else per_sample.sum()


def synthetic_batch(cfg: GPTConfig, batch_size: int, step: int, seed: int = 0, device: str | torch.device = "cpu"):
    """Deterministic (input, target) token batches: a noisy shifted-copy task the model can learn."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    base = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    noise = torch.randint(0, cfg.vocab_size, base.shape, generator=g)
    keep = torch.rand(base.shape, generator=g) < 0.8
    seq = torch.where(keep, base.roll(1, dims=1), noise)
    return seq[:, :-1].to(device), seq[:, 1:].to(device)
