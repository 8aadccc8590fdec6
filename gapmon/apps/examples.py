"""A small GPT-style language model, Swin V2's window attention and synthetic data, for the demo, tests and
benchmarks."""
from __future__ import annotations

import math
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


class WindowAttentionV2(nn.Module):
    """Swin V2's window attention with its continuous position bias, over 2 windows of window × window tokens per image
    (x [B, 2 · window², d]): the bias MLP (Linear, ReLU in place, Linear, as torchvision's and transformers') runs on a
    log-spaced table of relative coordinates (a buffer), its output is gathered by a relative position index every
    sample shares, permuted, squashed (16·sigmoid) and added to the scores of windows merged with the batch
    ([B·windows, heads, N, N]); cosine attention with a learned temperature. The per-sample tests and benchmarks'
    model of a computation every sample shares."""

    def __init__(self, d=8, heads=2, window=3, hidden=16):
        super().__init__()
        self.d, self.heads, self.window = d, heads, window
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.cpb_mlp = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, heads, bias=False))
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(heads, 1, 1)))
        span = torch.arange(-(window - 1), window, dtype=torch.float32)
        table = torch.stack(torch.meshgrid(span, span, indexing="ij"), -1) / (window - 1) * 8  # [2w-1, 2w-1, 2]
        self.register_buffer("table", (torch.sign(table) * torch.log2(table.abs() + 1) / math.log2(8)).unsqueeze(0))
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("index", (rel[..., 0] * (2 * window - 1) + rel[..., 1]).reshape(-1))

    def forward(self, x):  # x [B, 2 windows · N, d]
        b, n = x.shape[0], self.window ** 2
        windows = x.view(b, 2, n, self.d).reshape(b * 2, n, self.d)
        q, k, v = self.qkv(windows).view(b * 2, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        scores = scores * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        bias = self.cpb_mlp(self.table).view(-1, self.heads)[self.index].view(n, n, -1).permute(2, 0, 1).contiguous()
        scores = scores + 16 * torch.sigmoid(bias).unsqueeze(0)
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, 2 * n, self.d)
        return self.out(out).mean(1)


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
