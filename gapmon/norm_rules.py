"""Per-layer rules for per-sample gradient norms, registered by layer type (as Opacus registers
its grad samplers): one decorated class per layer family.

A rule turns one call of a layer (its input `a` and the gradient `g` of its output) into
*positions*: tensors of shape [B, T, ...] such that the per-sample gradient of every trainable
parameter is a sum over positions. Calls of the same module in one forward pass (a shared block
applied in a loop) then concatenate along T, which keeps the cross terms between calls exact.
`norm_sq` maps the (concatenated) positions to the squared per-sample norm, [B], of the layer's
trainable parameters only: frozen parameters have no gradient and add nothing.

Rules never materialise per-sample gradients where a cheaper exact form exists:
- Linear / Conv (unfolded): weight by the ghost norm sum((A Aᵀ) ⊙ (G Gᵀ)) or the direct
  ||Gᵀ A||², whichever needs fewer FLOPs; bias ||Σ_t G_t||².
- Embedding: Σ over positions with equal ids of G_t·G_s (padding_idx excluded; with
  scale_grad_by_freq each position is scaled by 1 / the count of its id in the sample).
- LayerNorm / RMSNorm / GroupNorm / InstanceNorm: weight ||Σ_t G_t ⊙ x̂_t||², bias ||Σ_t G_t||².
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops as _ops

_RULES: dict[type, "NormRule"] = {}


def register_norm_rule(*module_types: type) -> Callable[[type], type]:
    """Class decorator: the decorated NormRule handles these module types (and their subclasses)."""

    def register(cls: type) -> type:
        rule = cls()
        for t in module_types:
            _RULES[t] = rule
        return cls

    return register


def rule_for(module: nn.Module) -> "NormRule | None":
    """The rule of the most specific registered type that `module` is an instance of, or None."""
    for t in type(module).__mro__:
        if t in _RULES:
            return _RULES[t]
    return None


class NormRule:
    """How one layer family turns (input, output gradient) into per-sample squared norms."""

    def unsupported(self, module: nn.Module) -> str | None:
        """Why this module's per-sample norms cannot be computed exactly (None: they can)."""
        return None

    def params(self, module: nn.Module) -> list[nn.Parameter]:
        """The trainable parameters whose norms this rule covers."""
        return [p for p in module.parameters(recurse=False) if p.requires_grad]

    def positions(self, module: nn.Module, a: torch.Tensor, g: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def norm_sq(self, module: nn.Module, pos: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


def _trainable(p: torch.Tensor | None) -> bool:
    return p is not None and p.requires_grad


def _bias_sq(g: torch.Tensor) -> torch.Tensor:
    return g.sum(1).square().sum(1)


# -------------------------------------------------------------------- Linear-like products
def use_ghost(t: int, d: int, p: int) -> bool:
    """Ghost norm (Grams, B·T²·(d+p) FLOPs) when it is cheaper than the direct form (B·T·d·p)."""
    return t * (d + p) < d * p


def _ghost(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return _ops.ghost_norm_sq(a, g)


def _direct(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return _ops.direct_norm_sq(a, g)


def product_norm_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """||Σ_t g_t a_tᵀ||²_F per sample for a [B, T, d] and g [B, T, p]."""
    t, d, p = a.shape[1], a.shape[2], g.shape[2]
    if t == 1:
        return a.square().sum((1, 2)) * g.square().sum((1, 2))
    return _ghost(a, g) if use_ghost(t, d, p) else _direct(a, g)


@register_norm_rule(nn.Linear)
class LinearRule(NormRule):
    def positions(self, module, a, g, acc):
        b = g.shape[0]
        return a.to(acc).reshape(b, -1, a.shape[-1]), g.to(acc).reshape(b, -1, g.shape[-1])

    def norm_sq(self, module, pos):
        a, g = pos
        out = torch.zeros(g.shape[0], dtype=g.dtype, device=g.device)
        if _trainable(module.weight):
            out = out + product_norm_sq(a, g)
        if _trainable(module.bias):
            out = out + _bias_sq(g)
        return out


def _unfold(x: torch.Tensor, module: nn.modules.conv._ConvNd) -> torch.Tensor:
    """[B, C, *spatial] -> [B, L, C·k] patches in the column order of weight.reshape(out, -1)."""
    n = len(module.kernel_size)
    if isinstance(module.padding, str):  # "same" / "valid": the padding F.conv applies
        pads = []
        for k, dil in zip(reversed(module.kernel_size), reversed(module.dilation)):
            total = 0 if module.padding == "valid" else dil * (k - 1)
            pads += [total // 2, total - total // 2]
    else:
        pads = [p for p in reversed(module.padding) for _ in range(2)]
    x = F.pad(x, pads)
    for i in range(n):
        k, s, dil = module.kernel_size[i], module.stride[i], module.dilation[i]
        x = x.unfold(2 + i, dil * (k - 1) + 1, s)
        if dil > 1:
            x = x[..., ::dil]
    # x: [B, C, L_1..L_n, k_1..k_n] -> [B, L_1..L_n, C, k_1..k_n] -> [B, L, C·k]
    b, c = x.shape[0], x.shape[1]
    perm = [0] + list(range(2, 2 + n)) + [1] + list(range(2 + n, 2 + 2 * n))
    x = x.permute(perm)
    return x.reshape(b, -1, c * math.prod(module.kernel_size))


@register_norm_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(NormRule):
    def unsupported(self, module):
        if module.padding_mode != "zeros":
            return f"padding_mode={module.padding_mode!r} (only 'zeros' is unfolded)"
        return None

    def positions(self, module, a, g, acc):
        b, groups = g.shape[0], module.groups
        if a.dim() == len(module.kernel_size) + 1:  # unbatched input: not per-sample (filtered earlier)
            raise ValueError("unbatched convolution input")
        cols = _unfold(a.to(acc), module)  # [B, L, C·k]
        grads = g.to(acc).reshape(b, g.shape[1], -1).transpose(1, 2)  # [B, L, out]
        if groups > 1:  # each group is its own product: [B, L, G, ·] -> [B·G, L, ·]
            cols = cols.reshape(b, cols.shape[1], groups, -1).transpose(1, 2).reshape(b * groups, cols.shape[1], -1)
            grads = grads.reshape(b, grads.shape[1], groups, -1).transpose(1, 2).reshape(b * groups, grads.shape[1], -1)
        return cols, grads

    def norm_sq(self, module, pos):
        cols, grads = pos
        groups = module.groups
        b = grads.shape[0] // groups
        out = torch.zeros(b, dtype=grads.dtype, device=grads.device)
        if _trainable(module.weight):
            out = out + product_norm_sq(cols, grads).reshape(b, groups).sum(1)
        if _trainable(module.bias):
            out = out + _bias_sq(grads).reshape(b, groups).sum(1)
        return out


# -------------------------------------------------------------------- embeddings
@register_norm_rule(nn.Embedding)
class EmbeddingRule(NormRule):
    def positions(self, module, a, g, acc):
        b = g.shape[0]
        ids = a.reshape(b, -1)
        g = g.to(acc).reshape(b, ids.shape[1], -1)
        return ids, g

    def norm_sq(self, module, pos):
        ids, g = pos
        if not _trainable(module.weight):
            return torch.zeros(g.shape[0], dtype=g.dtype, device=g.device)
        if module.scale_grad_by_freq:
            # Each position's gradient is divided by how often its id occurs in the sample.
            counts = (ids.unsqueeze(2) == ids.unsqueeze(1)).sum(2)
            g = g / counts.unsqueeze(2).to(g.dtype)
        padding = -1 if module.padding_idx is None else module.padding_idx
        return _ops.embedding_norm_sq(ids, g, padding)


# -------------------------------------------------------------------- normalisation layers
class _AffineNormRule(NormRule):
    """Layers y = x̂ ⊙ weight + bias with per-position x̂: positions are (x̂, g) as [B, T, n]."""

    def normalized(self, module, a: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def norm_sq(self, module, pos):
        xhat, g = pos
        out = torch.zeros(g.shape[0], dtype=g.dtype, device=g.device)
        if _trainable(getattr(module, "weight", None)):
            out = out + (g * xhat).sum(1).square().sum(1)
        if _trainable(getattr(module, "bias", None)):
            out = out + _bias_sq(g)
        return out


@register_norm_rule(nn.LayerNorm, nn.RMSNorm)
class LastDimsNormRule(_AffineNormRule):
    def positions(self, module, a, g, acc):
        shape = tuple(module.normalized_shape)
        if isinstance(module, nn.LayerNorm):
            xhat = F.layer_norm(a.to(acc), shape, eps=module.eps)
        else:
            xhat = F.rms_norm(a.to(acc), shape, eps=module.eps)
        b, n = g.shape[0], math.prod(shape)
        return xhat.reshape(b, -1, n), g.to(acc).reshape(b, -1, n)


def _channels_last_positions(x: torch.Tensor) -> torch.Tensor:
    """[B, C, *spatial] -> [B, spatial, C]: the per-channel affine parameters sum over positions."""
    b, c = x.shape[0], x.shape[1]
    return x.reshape(b, c, -1).transpose(1, 2)


@register_norm_rule(nn.GroupNorm)
class GroupNormRule(_AffineNormRule):
    def positions(self, module, a, g, acc):
        xhat = F.group_norm(a.to(acc), module.num_groups, eps=module.eps)
        return _channels_last_positions(xhat), _channels_last_positions(g.to(acc))


@register_norm_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
class InstanceNormRule(_AffineNormRule):
    def unsupported(self, module):
        if module.track_running_stats:
            return "track_running_stats=True (eval mode normalises with running statistics)"
        return None

    def positions(self, module, a, g, acc):
        xhat = F.instance_norm(a.to(acc), eps=module.eps)
        return _channels_last_positions(xhat), _channels_last_positions(g.to(acc))


# -------------------------------------------------------------------- modules that bypass children
# These modules read their submodules' parameters directly instead of calling them, so a rule of
# the submodule would never see a call; their parameters are reported as uncovered.
BYPASSING_MODULES: tuple[type, ...] = (nn.MultiheadAttention,)
