"""The gradient torch's fused attention (`F.scaled_dot_product_attention`) gives its mask, recomputed per sample.

A float mask is added to the scaled scores inside the op, so each sample's gradient of it is that sample's gradient of
the scores, dS = P ⊙ (dP − rowsum(dP ⊙ P)) with P = softmax(scale · Q Kᵀ + mask) and dP = dO Vᵀ: formed here from the
call's q, k, v and mask and its output's gradient dO, for a mask every sample shares (Swin's and BEiT's relative
position bias, T5's) whose owner reads per-sample gradients where it is added to the batch (batch_provenance)."""
from __future__ import annotations

from typing import Callable

import torch


class ScoresGradient:
    """Stands for the scores a mask is added to inside the fused op (which autograd never shows): the shape and
    `register_hook` of a tensor, its hooks called with the recomputed dS (`deliver`)."""

    def __init__(self, shape: torch.Size, requires_grad: bool):
        self.shape, self.requires_grad = torch.Size(shape), requires_grad
        self.hooks: list[Callable[[torch.Tensor], None]] = []

    def dim(self) -> int:
        return len(self.shape)

    def register_hook(self, hook: Callable[[torch.Tensor], None]) -> None:
        self.hooks.append(hook)

    def deliver(self, ds: torch.Tensor) -> None:
        for hook in self.hooks:
            hook(ds)


def scores_shape(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Size | None:
    """The shape of the scores [..., heads, Tq, Tk] when the mask broadcasts to it (None where it does not)."""
    shape = torch.Size((*q.shape[:-1], k.shape[-2]))
    try:
        return shape if torch.broadcast_shapes(shape, mask.shape) == shape else None
    except RuntimeError:
        return None


def scores_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
                gqa: bool, d_out: torch.Tensor) -> torch.Tensor:
    """dS of `F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)` for the output
    gradient d_out (no dropout, not causal), in float32 (float64 for float64 inputs), in d_out's layout."""
    wide = torch.float64 if torch.float64 in (q.dtype, d_out.dtype) else torch.float32
    q, k, v, mask, d_out = (t.detach().to(wide) for t in (q, k, v, mask, d_out))
    if gqa and k.shape[-3] != q.shape[-3]:  # each key/value head serves q.shape[-3] / k.shape[-3] query heads
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    p = torch.softmax(q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale) + mask, dim=-1)
    dp = d_out @ v.transpose(-2, -1)
    return p * (dp - (dp * p).sum(-1, keepdim=True))
