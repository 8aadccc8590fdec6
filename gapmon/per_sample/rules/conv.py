"""Per-sample norms of nn.Conv1d/2d/3d: Linear products over unfolded patches, per group.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ... import _torch_compat
from .base import (
    NormRule,
    Sketch,
    bias_norm_sq,
    register_norm_rule,
    register_norm_rule_by_name,
    sketch,
    sum_of_terms,
    trainable,
)
from .linear import product_norm_sq


def unfold_patches(x: torch.Tensor, module: _torch_compat.ConvNdBase, grid: Sequence[int] | None = None) -> torch.Tensor:
    """[B, C, *spatial] -> [B, L, C·k] patches in the column order of weight.reshape(out, -1). `grid`: keep only
    the first grid[i] patch positions along spatial dim i (a transposed convolution's output gradient has more
    positions than its input where output_padding ≥ stride adds rows: no input position reads them).
    A padding_mode other than "zeros" pads as the convolution's own forward does (reflected, replicated or circular
    rows, then no padding)."""
    n = len(module.kernel_size)
    if isinstance(module.padding, str):  # "same" / "valid": the padding F.conv applies
        pads = []
        for k, dil in zip(reversed(module.kernel_size), reversed(module.dilation)):
            total = 0 if module.padding == "valid" else dil * (k - 1)
            pads += [total // 2, total - total // 2]
    else:
        pads = [p for p in reversed(module.padding) for _ in range(2)]
    x = F.pad(x, pads) if module.padding_mode == "zeros" else F.pad(x, pads, mode=module.padding_mode)
    for i in range(n):
        k, s, dil = module.kernel_size[i], module.stride[i], module.dilation[i]
        x = x.unfold(2 + i, dil * (k - 1) + 1, s)
        if dil > 1:
            x = x[..., ::dil]
    if grid is not None:
        found = tuple(x.shape[2:2 + n])
        if any(f < g for f, g in zip(found, grid)):
            raise RuntimeError(f"unfold_patches: {found} patch positions, fewer than the {tuple(grid)} asked for")
        x = x[(slice(None), slice(None)) + tuple(slice(0, g) for g in grid)]
    # x: [B, C, L_1..L_n, k_1..k_n] -> [B, L_1..L_n, C, k_1..k_n] -> [B, L, C·k]
    b, c = x.shape[0], x.shape[1]
    perm = [0] + list(range(2, 2 + n)) + [1] + list(range(2 + n, 2 + 2 * n))
    x = x.permute(perm)
    return x.reshape(b, -1, c * math.prod(module.kernel_size))


@register_norm_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(NormRule):
    def not_per_sample(self, module, call, output, batch, model_inputs):
        a = call.arg(0, "input")
        if isinstance(a, torch.Tensor) and a.dim() == len(module.kernel_size) + 1:
            return "its input is unbatched"
        return super().not_per_sample(module, call, output, batch, model_inputs)

    def positions(self, module, call, g, acc):
        a, b, groups = call.arg(0, "input"), g.shape[0], module.groups
        cols = unfold_patches(a.to(acc), module)  # [B, L, C·k]
        grads = g.to(acc).reshape(b, g.shape[1], -1).transpose(1, 2)  # [B, L, out]
        if groups > 1:  # each group is its own product: [B, L, G, ·] -> [B·G, L, ·]
            cols = cols.reshape(b, cols.shape[1], groups, -1).transpose(1, 2).reshape(b * groups, cols.shape[1], -1)
            grads = grads.reshape(b, grads.shape[1], groups, -1).transpose(1, 2).reshape(b * groups, grads.shape[1], -1)
        return cols, grads

    def norm_sq(self, module, pos):
        cols, grads = pos
        groups = module.groups
        b = grads.shape[0] // groups
        terms = [product_norm_sq(cols, grads).reshape(b, groups).sum(1)] if trainable(module.weight) else []
        if trainable(module.bias):
            terms.append(bias_norm_sq(grads).reshape(b, groups).sum(1))
        return sum_of_terms(terms, b, grads.dtype, grads.device)

    def per_sample_grads(self, module, pos, batch):
        """Group j's weight rows are Σ_l g_lᵀ cols_l of group j (the unfolded product); the bias Σ_l g_l."""
        cols, grads = (t.double() for t in pos)
        groups = module.groups
        length = grads.shape[1]
        grads = grads.reshape(batch, groups, length, -1)
        out = []
        if trainable(module.weight):
            w = torch.einsum("bglo,bglc->bgoc", grads, cols.reshape(batch, groups, length, -1))
            out.append((module.weight, w.reshape(batch, *module.weight.shape)))
        if trainable(module.bias):
            out.append((module.bias, grads.sum(2).reshape(batch, -1)))
        return out

    def grad_sketch(self, module, pos, probe):
        cols, grads = pos
        groups = module.groups
        b, length = grads.shape[0] // groups, grads.shape[1]
        grads = grads.reshape(b, groups, length, -1)
        out = []
        if trainable(module.weight):  # weight [out, C/G, k...]: group j's rows pair with group j's columns
            r = probe(module.weight)
            ar = cols.reshape(b, groups, length, -1).to(r.dtype) @ r  # [B, G, L]
            out.append(Sketch(module.weight, torch.einsum("bglo,bgl->go", grads.to(r.dtype), ar).reshape(-1).double()))
        if trainable(module.bias):
            out.append(Sketch(module.bias, sketch(grads.sum((0, 2)).reshape(-1), probe(module.bias))))
        return out


@register_norm_rule_by_name("timm.layers.std_conv.StdConv2d", "timm.layers.std_conv.ScaledStdConv2d")
class StandardisedConvRule(ConvRule):
    """Convolutions that standardise their weight per output channel before use (timm's StdConv2d and
    ScaledStdConv2d: BiT's ResNetV2, NF-Nets): Ŵ_o = γ_o (w_o - mean w_o) / σ_o, σ_o = sqrt(var w_o + eps) (the biased
    variance, as F.batch_norm in training forms it), γ = gain · scale (ScaledStdConv2d) or 1. Each sample's gradient
    D of Ŵ (Σ_l gᵀ cols over its patches, formed) goes back through the standardisation as a LayerNorm's backward does,
    row by row: (γ/σ)(D - mean D - ẑ mean(D ⊙ ẑ)), ẑ = (w - mean w)/σ; the gain's is scale · Σ D ⊙ ẑ."""

    param_names = ("weight", "bias", "gain")

    def unsupported(self, module):
        if not isinstance(getattr(module, "eps", None), float):
            return "it has no float eps this rule can read"
        if hasattr(module, "gain") and not isinstance(getattr(module, "scale", None), float):
            return "it has a gain but no float scale this rule can read"
        return None

    def per_sample_parts(self, module, pos) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, [B, *its shape] each sample's gradient) of every trainable parameter of one call's positions."""
        cols, grads = pos
        groups, out_channels = module.groups, module.out_channels
        b, length = grads.shape[0] // groups, grads.shape[1]
        grads = grads.reshape(b, groups, length, -1)
        d = torch.einsum("bglo,bglc->bgoc", grads, cols.reshape(b, groups, length, -1)).reshape(b, out_channels, -1)
        w = module.weight.detach().to(d.dtype).reshape(out_channels, -1)
        centred = w - w.mean(1, keepdim=True)
        sigma = (centred.square().mean(1, keepdim=True) + module.eps).sqrt()
        z = centred / sigma
        gain = getattr(module, "gain", None)
        gamma = gain.detach().to(d.dtype).reshape(-1, 1) * module.scale if gain is not None else 1.0
        parts = []
        if trainable(module.weight):
            dw = (gamma / sigma) * (d - d.mean(-1, keepdim=True) - z * (d * z).mean(-1, keepdim=True))
            parts.append((module.weight, dw.reshape(b, *module.weight.shape)))
        if trainable(gain):
            parts.append((gain, (module.scale * (d * z).sum(-1)).reshape(b, *gain.shape)))
        if trainable(module.bias):
            parts.append((module.bias, grads.sum(2).reshape(b, -1)))
        return parts

    def norm_sq_and_grads(self, module, pos):
        parts = self.per_sample_parts(module, pos)
        grads = pos[1]
        b = grads.shape[0] // module.groups
        terms = [g.reshape(b, -1).square().sum(1) for _, g in parts]
        return sum_of_terms(terms, b, grads.dtype, grads.device), [(p, g.sum(0)) for p, g in parts]

    def norm_sq(self, module, pos):
        return self.norm_sq_and_grads(module, pos)[0]

    def per_sample_grads(self, module, pos, batch):
        return [(p, g.double()) for p, g in self.per_sample_parts(module, pos)]

    def grad_sketch(self, module, pos, probe):
        return [Sketch(p, sketch(g.sum(0), probe(p))) for p, g in self.per_sample_parts(module, pos)]
