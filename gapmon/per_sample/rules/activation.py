"""Per-sample norms of layers whose parameters scale an activation: nn.PReLU, y = max(0, x) + w · min(0, x).

A sample's gradient of w is Σ g · min(0, x) over its positions, per channel (dim 1 of the input; all of them for a
single w). The rule reduces each call to those sums right away ([B, 1, C]: calls concatenate along dim 1, and the
norm is taken of their sum).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .base import NormRule, Sketch, register_norm_rule, sketch, trainable


@register_norm_rule(nn.PReLU)
class PReLURule(NormRule):
    param_names = ("weight",)

    def not_per_sample(self, module, call, output, batch, model_inputs):
        x = call.arg(0, "input")
        if isinstance(x, torch.Tensor) and x.dim() < 2:
            return "its input is unbatched"
        return super().not_per_sample(module, call, output, batch, model_inputs)

    def positions(self, module, call, g, acc):
        x = call.arg(0, "input").to(acc)
        part = g.to(acc) * x.clamp(max=0)
        c = module.weight.numel()
        if c == 1:
            sums = part.reshape(part.shape[0], -1).sum(1, keepdim=True)
        else:  # channels on dim 1
            sums = part.transpose(0, 1).reshape(c, part.shape[0], -1).sum(2).T
        return (sums.unsqueeze(1),)

    def norm_sq(self, module, pos):
        (sums,) = pos
        if not trainable(module.weight):
            return sums.new_zeros(sums.shape[0])
        return sums.sum(1).square().sum(1)

    def grad_sketch(self, module, pos, probe):
        if not trainable(module.weight):
            return []
        (sums,) = pos
        return [Sketch(module.weight, sketch(sums.sum((0, 1)), probe(module.weight)))]
