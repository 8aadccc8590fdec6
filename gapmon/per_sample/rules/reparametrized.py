"""Linear and (transposed) convolution layers whose weight is reparametrised, W = f(θ), by torch's weight_norm or
spectral_norm (as parametrizations, `torch.nn.utils.parametrizations`, or in their older hook-based forms): wav2vec 2's
and HuBERT's positional convolution (weight_norm over dim 2), HiFi-GAN's upsampling (weight_norm'd transposed
convolutions), GAN discriminators and critics (spectral_norm).

Each sample's gradient D of W is formed by the layer's own rule (per_sample_grads, float64) and taken back to θ in
closed form, as autograd does for the whole batch:
- weight_norm, W = g v / ||v|| (the norm over every dim but `dim`): with v̂ = v / ||v||, dg = Σ D ⊙ v̂ over the
  normalised dims, dv = (g / ||v||)(D - dg v̂); ||v|| as torch's own kernel forms it (torch_norms).
- spectral_norm, W = W₀ / σ with σ = uᵀ M v, M = W₀ as a matrix along `dim` and u, v its power iteration's vectors (no
  gradient through them): dW₀ = (D - (⟨D, W₀⟩ / σ) u vᵀ) / σ, u vᵀ laid out as W₀. u and v are read in backward: a
  forward in between that runs the power iteration again (a second call in training mode) changes them, and the use
  check then finds the sums differ from autograd's and leaves the layer out.
- any other chain of parametrizations of the weight (orthogonal, weight_norm stacked with another, a user's own): the
  chain formed again in float64 from its originals (its buffers copied, so a chain that updates them leaves the
  model's alone) and each sample's D taken back through it by a vector-Jacobian product, batched over the samples.
  A chain with spectral_norm in it is left out (its power iteration moves u and v at each forward: formed again, it
  would not be the forward's W); a chain that forms another W when formed again (a random one) is caught by the use
  check.
The bias is the layer's own. Not book-kept. Per-sample gradients of W are formed (batch × W's elements).
"""
from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn

from ... import _torch_compat
from .base import NormRule, Sketch, register_rule_wrapper, sketch, sum_of_terms, trainable

# What the wrapper takes from the layer's own rule as it is (attributes read by the hooks and the tracking).
_DELEGATED = ("moves_batch", "merged_rows", "keeps_rows_only", "compute_dtype", "factored_probe", "reads_shared_rows")


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


def spectral_norm_grads(d: torch.Tensor, original: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                        dim: int) -> torch.Tensor:
    """The gradients [B, *W₀.shape] of W₀ of W = W₀ / σ, σ = uᵀ M v (M: W₀ with `dim` first, flattened after it), from
    the gradients d [B, *W.shape] of W: (d - (⟨d, W₀⟩ / σ) u vᵀ) / σ, σ formed as torch's forward forms it."""
    order = (dim, *(i for i in range(original.dim()) if i != dim))
    with torch.no_grad():
        sigma = torch.vdot(u, torch.mv(original.permute(order).flatten(1), v)).double()
    w = original.detach().double()
    outer = torch.outer(u.double(), v.double()).reshape([original.shape[i] for i in order])
    outer = outer.permute([order.index(i) for i in range(original.dim())])  # u vᵀ laid out as W₀
    along = tuple(range(1, d.dim()))
    inner = (d * w).sum(along, keepdim=True)  # [B, 1, ...]: ⟨d_i, W₀⟩
    return (d - (inner / sigma) * outer) / sigma


class Reparametrization:
    """How W is formed from the parameters θ (`params`): W's shape, and each θ's gradients from W's (`back`)."""

    def __init__(self, params: tuple[torch.Tensor, ...], shape: torch.Size | None, dim: int):
        self.params, self._shape, self.dim = params, shape, dim

    @property
    def shape(self) -> torch.Size:
        """W's shape."""
        return self._shape

    def back(self, d: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(θ, its gradients [B, *θ.shape]) of each trainable θ from the gradients d [B, *W.shape] of W."""
        raise NotImplementedError


class WeightNorm(Reparametrization):
    """W = g v / ||v||, the norm over every dim but `dim`."""

    def __init__(self, g: torch.Tensor, v: torch.Tensor, dim: int):
        super().__init__((g, v), v.shape, dim)

    def back(self, d):
        g, v = (p.detach() for p in self.params)
        dg, dv = weight_norm_grads(d, g.double(), v.double(), self.dim, torch_norms(g, v, self.dim))
        return [(q, grads) for q, grads in zip(self.params, (dg, dv)) if trainable(q)]


class SpectralNorm(Reparametrization):
    """W = W₀ / σ, σ the largest singular value of W₀ (as a matrix along `dim`) by power iteration: u, v."""

    def __init__(self, original: torch.Tensor, u: torch.Tensor, v: torch.Tensor, dim: int):
        super().__init__((original,), original.shape, dim)
        self.u, self.v = u, v

    def back(self, d):
        (original,) = self.params
        return [(original, spectral_norm_grads(d, original, self.u, self.v, self.dim))] if trainable(original) else []


class Chain(Reparametrization):
    """W = f(θ₀, θ₁, ...) by a chain of parametrizations (torch.nn.utils.parametrize) without a closed form here: each
    θ's per-sample gradients by a vector-Jacobian product of f, formed again in float64, batched over the samples."""

    def __init__(self, chain: nn.Module):
        names = ["original"] if chain.is_tensor else [f"original{i}" for i in range(chain.ntensors)]
        super().__init__(tuple(getattr(chain, n) for n in names), None, -1)
        self.chain, self.names = chain, names
        self._formed: tuple | None = None

    def _form(self) -> tuple:
        """(W in float64, the float64 originals it was formed from, with autograd's graph): the chain run on float64
        copies of its originals and of its buffers (a chain that updates a buffer updates the copy)."""
        if self._formed is None:
            originals = [p.detach().double().requires_grad_(trainable(p)) for p in self.params]
            buffers = {n: b.detach().double() if b.is_floating_point() else b.detach().clone()
                       for n, b in self.chain.named_buffers() if b is not None}
            with torch.enable_grad():
                formed = torch.func.functional_call(self.chain, {**dict(zip(self.names, originals)), **buffers}, ())
            self._formed = (formed, originals)
        return self._formed

    @property
    def shape(self) -> torch.Size:
        return self._form()[0].shape

    def back(self, d):
        formed, originals = self._form()
        pairs = [(p, o) for p, o in zip(self.params, originals) if trainable(p)]
        if not pairs:
            return []
        with warnings.catch_warnings():  # a batching rule torch lacks falls back to a loop over the samples: slower, exact
            warnings.filterwarnings("ignore", message=".*performance drop.*")
            grads = torch.autograd.grad(formed, [o for _, o in pairs], d.double(), is_grads_batched=True,
                                        allow_unused=True)
        return [(p, d.new_zeros(d.shape[0], *o.shape, dtype=torch.float64) if g is None else g)
                for (p, o), g in zip(pairs, grads)]


def reparametrization_of(module: nn.Module) -> Reparametrization | None:
    """How `module.weight` is formed where it is reparametrised and nothing else is: one weight_norm or spectral_norm of
    a weight of 2 dims or more (a parametrization, or the hook-based form), or another chain of parametrizations of the
    weight without spectral_norm (Chain); None otherwise."""
    parametrizations = getattr(module, "parametrizations", None)
    if parametrizations is not None:
        from torch.nn.utils.parametrizations import _SpectralNorm, _WeightNorm

        chain = parametrizations["weight"] if set(parametrizations.keys()) == {"weight"} else None
        if chain is None:
            return None
        if len(chain) == 1 and type(chain[0]) is _WeightNorm:
            return WeightNorm(chain.original0, chain.original1, chain[0].dim)
        if len(chain) == 1 and type(chain[0]) is _SpectralNorm and chain.original.dim() > 1:
            return SpectralNorm(chain.original, chain[0].get_buffer("_u"), chain[0].get_buffer("_v"), chain[0].dim)
        if any(isinstance(m, _SpectralNorm) for m in chain):  # its power iteration: formed again, another W
            return None
        return Chain(chain)
    from torch.nn.utils.spectral_norm import SpectralNorm as SpectralNormHook
    from torch.nn.utils.weight_norm import WeightNorm as WeightNormHook

    hooks = [h for h in _torch_compat.forward_pre_hooks(module) if isinstance(h, (WeightNormHook, SpectralNormHook))]
    if len(hooks) != 1 or hooks[0].name != "weight":
        return None
    if isinstance(hooks[0], WeightNormHook):
        return WeightNorm(module.weight_g, module.weight_v, hooks[0].dim)
    return SpectralNorm(module.weight_orig, module.weight_u, module.weight_v, hooks[0].dim)


class ReparametrizedRule(NormRule):
    """The rule of a layer whose weight is reparametrised: the layer's own rule (`inner`: Linear's or a
    convolution's) for its calls and positions; the parameters' gradients from its per-sample weight gradients."""

    param_names = None
    owns_submodules = True  # θ lives in its parametrization's container: the layer's, not a layer of their own

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
        known = {"bias", "weight_g", "weight_v", "weight_orig"}
        own = {name for name, p in module.named_parameters(recurse=False) if p is not None}
        if own - known:
            return f"it has parameters {sorted(own - known)} its rule does not know"
        return self.inner.unsupported(module)

    def params(self, module):
        found = reparametrization_of(module)
        return [p for p in (*(found.params if found is not None else ()), getattr(module, "bias", None))
                if trainable(p)]

    def per_sample_grads(self, module, pos, batch):
        """(each trainable parameter, its [batch, *shape] float64 per-sample gradients)."""
        found = reparametrization_of(module)
        if found is None:
            raise RuntimeError(f"{type(module).__name__}: its weight is no longer reparametrised as it was")
        # The layer's rule reads the weight's shape and whether it trains, never its values: it is given a stand-in
        # (module.weight of a parametrization is formed at each read, and spectral_norm's runs its power iteration
        # then, changing u and v: the step's own and the next forward's).
        stand_in = SimpleNamespace(weight=torch.empty(found.shape, device="meta", requires_grad=True),
                                   bias=getattr(module, "bias", None), groups=getattr(module, "groups", 1))
        out = []
        for p, grads in self.inner.per_sample_grads(stand_in, pos, batch):
            out += found.back(grads) if p is stand_in.weight else [(p, grads)]
        return out

    def _batch(self, module, pos) -> int:
        """Samples in a call's positions: a convolution's hold each sample's groups as rows of their own (a transposed
        convolution's last one, its output gradient, does not)."""
        from .conv import ConvRule
        from .conv_transpose import ConvTransposeRule

        rows = pos[-1].shape[0]
        grouped = isinstance(self.inner, ConvRule) and not isinstance(self.inner, ConvTransposeRule)
        return rows // module.groups if grouped else rows

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
def reparametrized(rule: NormRule | None, module: nn.Module) -> NormRule | None:
    """The rule of `module`: `rule` (its type's), or, where its weight is reparametrised (weight_norm, spectral_norm)
    and its type's rule forms per-sample weight gradients (Linear's, a convolution's), that rule taken back to θ."""
    from .conv import ConvRule
    from .conv_transpose import ConvTransposeRule
    from .linear import LinearRule

    if rule is None or type(rule) not in (LinearRule, ConvRule, ConvTransposeRule) or reparametrization_of(module) is None:
        return rule
    wrapped = _WRAPPED.get(type(rule))
    if wrapped is None:
        wrapped = _WRAPPED[type(rule)] = ReparametrizedRule(rule)
    return wrapped


_WRAPPED: dict[type, Any] = {}
