"""A Linear or convolution whose weight is weight-normalised: W = g · v / ||v||, the norm over every dim but `dim` (over
all of v for dim=None), by `torch.nn.utils.parametrizations.weight_norm` (wav2vec 2's and HuBERT's positional
convolution, dim=2) or the older hook-based `torch.nn.utils.weight_norm` (its `weight_g`, `weight_v`).

Each sample's gradient D of W is formed by the layer's own rule (per_sample_grads) and taken back through the
normalisation in closed form, exactly as autograd does for the whole batch: with v̂ = v / ||v||,
dg = Σ D ⊙ v̂ (over the normalised dims) and dv = (g / ||v||)(D - dg · v̂). The bias is the layer's own. Not book-kept.
Per-sample gradients of W are formed (batch × W's elements, in float64): these layers are small.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ... import _torch_compat
from .base import NormRule, Sketch, register_rule_wrapper, sketch, sum_of_terms, trainable

# What the wrapper takes from the layer's own rule as it is (attributes read by the hooks and the tracking).
_DELEGATED = ("moves_batch", "merged_rows", "keeps_rows_only", "compute_dtype", "factored_probe", "reads_shared_rows")


def weight_norm_of(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(g, v, dim) where `module.weight` is weight_norm(v, g, dim) and nothing else (one parametrization of the weight
    alone, or the hook-based weight_norm); None otherwise."""
    parametrizations = getattr(module, "parametrizations", None)
    if parametrizations is not None:
        from torch.nn.utils.parametrizations import _WeightNorm

        chain = parametrizations["weight"] if set(parametrizations.keys()) == {"weight"} else None
        if chain is None or len(chain) != 1 or type(chain[0]) is not _WeightNorm:
            return None
        return chain.original0, chain.original1, chain[0].dim
    from torch.nn.utils.weight_norm import WeightNorm

    hooks = [h for h in _torch_compat.forward_pre_hooks(module) if isinstance(h, WeightNorm)]
    if len(hooks) != 1 or hooks[0].name != "weight":
        return None
    return module.weight_g, module.weight_v, hooks[0].dim


def _normalised_dims(v: torch.Tensor, dim: int) -> tuple[int, ...]:
    """The dims of v its norm runs over: every dim but `dim` (all of them for -1, as torch._weight_norm)."""
    return tuple(range(v.dim())) if dim == -1 else tuple(d for d in range(v.dim()) if d != dim)


def torch_norms(g: torch.Tensor, v: torch.Tensor, dim: int) -> torch.Tensor:
    """||v|| (g's shape) as torch's weight_norm forms it: its fused kernel's for the first or last dim (on CUDA a
    single-precision square root, float64 too: 2e-8 relative from the exact norm, which the float64 use check saw on
    an H200), the composite norm_except_dim otherwise. The per-sample gradients then use the norm autograd's do."""
    with torch.no_grad():
        if v.dim() > 1 and dim in (0, v.dim() - 1) and torch.float16 not in (v.dtype, g.dtype):
            return _torch_compat.fused_weight_norms(v, g, dim).reshape(g.shape)
        return torch.norm_except_dim(v, 2, dim).reshape(g.shape) if dim != -1 else v.norm().reshape(g.shape)


def weight_norm_grads(d: torch.Tensor, g: torch.Tensor, v: torch.Tensor, dim: int,
                      norm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of g, gradient of v) of W = g v / ||v|| from the gradients d [B, *W.shape] of W (B of them at once):
    dg = Σ d ⊙ v̂ over the normalised dims, dv = (g / ||v||)(d - dg v̂). `norm`: ||v|| as the forward formed it
    (torch_norms; default: exact)."""
    over = _normalised_dims(v, dim)
    norm = v.square().sum(over, keepdim=True).sqrt() if norm is None else norm.to(v.dtype).reshape(
        [v.shape[i] if i not in over else 1 for i in range(v.dim())])
    unit = v / norm
    dg = (d * unit).sum(tuple(i + 1 for i in over), keepdim=True)  # [B, 1.., size of dim, 1..]
    dv = (g.reshape(norm.shape) / norm) * (d - dg * unit)
    return dg.reshape(d.shape[0], *g.shape), dv


class WeightNormedRule(NormRule):
    """The rule of a weight-normalised layer: the layer's own rule (`inner`: Linear's or a convolution's) for its
    calls and positions; g's and v's gradients from its per-sample weight gradients."""

    param_names = None
    owns_submodules = True  # g and v live in its parametrization's container: the layer's, not a layer of their own

    def __init__(self, inner: NormRule):
        self.inner = inner
        for name in _DELEGATED:
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    # The calls and positions are the layer's own.
    def not_per_sample(self, module, call, output, batch, model_inputs):
        return self.inner.not_per_sample(module, call, output, batch, model_inputs)

    def graded_outputs(self, module, output):
        return self.inner.graded_outputs(module, output)

    def batch_operands(self, module, call):
        return self.inner.batch_operands(module, call)

    def positions(self, module, call, g, acc):
        return self.inner.positions(module, call, g, acc)

    def rounding_dtype(self, module, call, g):
        return self.inner.rounding_dtype(module, call, g)

    def why_not(self, module):
        own = {name for name, p in module.named_parameters(recurse=False) if p is not None}
        if own - {"bias", "weight_g", "weight_v"}:
            return f"it has parameters {sorted(own - {'bias', 'weight_g', 'weight_v'})} its rule does not know"
        return self.inner.unsupported(module)

    def params(self, module):
        found = weight_norm_of(module)
        g, v = (found[0], found[1]) if found is not None else (None, None)
        return [p for p in (g, v, getattr(module, "bias", None)) if trainable(p)]

    def per_sample_grads(self, module, pos, batch):
        """(g, v, bias: each trainable one) with its [batch, *shape] float64 per-sample gradients."""
        found = weight_norm_of(module)
        if found is None:
            raise RuntimeError(f"{type(module).__name__}: its weight is no longer weight-normalised")
        g, v, dim = found
        bias = getattr(module, "bias", None)
        with torch.enable_grad():  # (the layer's rule forms the weight's part where the weight, as formed now, trains)
            weight_shape, parts = module.weight.shape, self.inner.per_sample_grads(module, pos, batch)
        out = []
        for p, grads in parts:
            if p is bias:
                out.append((p, grads))
            elif p.shape == weight_shape:
                norm = torch_norms(g.detach(), v.detach(), dim)
                dg, dv = weight_norm_grads(grads, g.detach().double(), v.detach().double(), dim, norm)
                out += [(q, d) for q, d in ((g, dg), (v, dv)) if trainable(q)]
        return out

    def _batch(self, module, pos) -> int:
        """Samples in a call's positions: a convolution's hold each sample's groups as rows of their own."""
        from .conv import ConvRule

        rows = pos[-1].shape[0]
        return rows // module.groups if isinstance(self.inner, ConvRule) else rows

    def norm_sq_and_grads(self, module, pos):
        grads = pos[-1]
        batch = self._batch(module, pos)
        parts = self.per_sample_grads(module, pos, batch)
        terms = [d.reshape(batch, -1).square().sum(1) for _, d in parts]
        return (sum_of_terms(terms, batch, grads.dtype, grads.device).to(grads.dtype),
                [(p, d.sum(0).to(p.dtype)) for p, d in parts])

    def norm_sq(self, module, pos):
        return self.norm_sq_and_grads(module, pos)[0]

    def grad_sketch(self, module, pos, probe):
        return [Sketch(p, sketch(total, probe(p))) for p, total in self.norm_sq_and_grads(module, pos)[1]]

    def bookkeep(self, module, x, output, report):
        return None


@register_rule_wrapper
def weight_normed(rule: NormRule | None, module: nn.Module) -> NormRule | None:
    """The rule of `module`: `rule` (its type's), or, where its weight is weight-normalised and its type's rule forms
    per-sample weight gradients (Linear's, a convolution's), that rule taken back through the normalisation."""
    from .conv import ConvRule
    from .linear import LinearRule

    if rule is None or type(rule) not in (LinearRule, ConvRule) or weight_norm_of(module) is None:
        return rule
    wrapped = _WRAPPED.get(type(rule))
    if wrapped is None:
        wrapped = _WRAPPED[type(rule)] = WeightNormedRule(rule)
    return wrapped


_WRAPPED: dict[type, Any] = {}
