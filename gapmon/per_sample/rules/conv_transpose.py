"""Per-sample norms of nn.ConvTranspose1d/2d/3d: the same Linear products as a convolution, with the roles
of input and output gradient exchanged.

A transposed convolution y[co, p·s + k·d − pad] += x[ci, p] · W[ci, co, k] is the adjoint of a convolution,
so its weight gradient dL/dW[ci, co, k] = Σ_p x[ci, p] · g[co, p·s + k·d − pad] pairs each input position p
with the patch of the output gradient that the convolution of g with the same kernel, stride, dilation and
padding reads there: the L = prod(input sizes) patches `conv.unfold_patches` cuts from g at the input's positions
(rows that output_padding or `output_size` add at the end give further patch positions along a dim when they reach
a stride: no input position pairs with those, so they are cut off). The per-sample gradient of group j is then Σ_p x_p ⊗ patch_p, a Linear
product with A = the patches and G = the inputs.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .base import Sketch, bias_norm_sq, register_norm_rule, sketch, sum_of_terms, trainable
from .conv import ConvRule, unfold_patches
from .linear import product_norm_sq


@register_norm_rule(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
class ConvTransposeRule(ConvRule):
    """A convolution's check of an unbatched input; its own products."""

    def positions(self, module, call, g, acc):
        """(patches of g [B·G, L, (C_out/G)·k], inputs [B·G, L, C_in/G], output gradient [B, Q, C_out])."""
        x, b, groups = call.arg(0, "input"), g.shape[0], module.groups
        patches = unfold_patches(g.to(acc), module, grid=x.shape[2:])  # [B, L, C_out·k], L = the input's positions
        inputs = x.to(acc).reshape(b, x.shape[1], -1).transpose(1, 2)  # [B, L, C_in]
        length = inputs.shape[1]
        patches = patches.reshape(b, length, groups, -1).transpose(1, 2).reshape(b * groups, length, -1)
        inputs = inputs.reshape(b, length, groups, -1).transpose(1, 2).reshape(b * groups, length, -1)
        outputs = g.to(acc).reshape(b, g.shape[1], -1).transpose(1, 2)
        return patches, inputs, outputs

    def norm_sq(self, module, pos):
        patches, inputs, outputs = pos
        b = outputs.shape[0]
        terms = [product_norm_sq(patches, inputs).reshape(b, module.groups).sum(1)] if trainable(module.weight) else []
        if trainable(module.bias):
            terms.append(bias_norm_sq(outputs))
        return sum_of_terms(terms, b, outputs.dtype, outputs.device)

    def per_sample_grads(self, module, pos, batch):
        """Row ci of group j: Σ_l x[ci, l] · patch_l of group j; the bias: the output gradient summed."""
        patches, inputs, outputs = (t.double() for t in pos)
        groups, length = module.groups, inputs.shape[1]
        out = []
        if trainable(module.weight):
            w = torch.einsum("bgli,bglc->bgic", inputs.reshape(batch, groups, length, -1),
                             patches.reshape(batch, groups, length, -1))
            out.append((module.weight, w.reshape(batch, *module.weight.shape)))
        if trainable(module.bias):
            out.append((module.bias, outputs.sum(1)))
        return out

    def grad_sketch(self, module, pos, probe):
        patches, inputs, outputs = pos
        groups, b = module.groups, outputs.shape[0]
        length = inputs.shape[1]
        out = []
        if trainable(module.weight):  # weight [C_in, C_out/G, k...]: row ci of group j pairs with group j's patches
            r = probe(module.weight)
            pr = patches.reshape(b, groups, length, -1).to(r.dtype) @ r  # [B, G, L]
            rows = torch.einsum("bgli,bgl->gi", inputs.reshape(b, groups, length, -1).to(r.dtype), pr)
            out.append(Sketch(module.weight, rows.reshape(-1).double()))
        if trainable(module.bias):
            out.append(Sketch(module.bias, sketch(outputs.sum((0, 1)), probe(module.bias))))
        return out
