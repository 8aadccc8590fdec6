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
- EmbeddingBag: the entries of each bag, weighted, paired by id as for Embedding.
- MultiheadAttention: its projections as Linear products, from a recomputed attention.

Each rule also gives `grad_sketch`: the sum over samples of its per-sample gradients (what autograd
accumulates from the calls the rule saw), projected on a random probe per parameter. A parameter
whose accumulated gradient differs from it got contributions no rule saw (gapmon.per_sample
refuses it): a Freivalds check that costs a matrix-vector product, not a gradient.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _backend, _torch_compat

_RULES: dict[type, "NormRule"] = {}


def register_norm_rule(*module_types: type) -> Callable[[type], type]:
    """Class decorator: the decorated NormRule handles these module types, and their subclasses that
    do not override `forward`. A subclass whose forward computes what its base's does (gapmon cannot
    tell) is registered by its user: ``register_norm_rule(MyLinear)(gapmon.norm_rules.LinearRule)``."""

    def register(cls: type) -> type:
        rule = cls()
        for t in module_types:
            _RULES[t] = rule
        return cls

    return register


def rule_for(module: nn.Module) -> "NormRule | None":
    """The rule registered for `module`'s type; for a subclass of a registered type, that type's rule
    only if the subclass does not override `forward` (else its math may differ: a LoRA Linear, a
    scaled Embedding). None when no rule holds."""
    kind = type(module)
    if kind in _RULES:
        return _RULES[kind]
    base = _registered_base(kind)
    return _RULES[base] if base is not None and kind.forward is base.forward else None


def _registered_base(kind: type) -> type | None:
    return next((t for t in kind.__mro__[1:] if t in _RULES), None)


def why_no_rule(module: nn.Module) -> str:
    """Why `module` has no rule (rule_for gave None), for coverage() and the warnings."""
    kind = type(module)
    base = _registered_base(kind)
    if base is not None:
        return (f"{kind.__name__} subclasses {base.__name__} but overrides forward, so {base.__name__}'s rule may not "
                f"hold; if its math is {base.__name__}'s, register it: register_norm_rule({kind.__name__})(...)")
    return f"no per-sample rule for {kind.__name__}"


class Call(NamedTuple):
    """The arguments of one call of a layer (tensors detached), as its forward hook saw them."""

    args: tuple
    kwargs: dict

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Argument `index` of forward(), passed by position or by keyword `name`."""
        return self.args[index] if len(self.args) > index else self.kwargs.get(name, default)


class NormRule:
    """How one layer family turns (call arguments, output gradient) into per-sample squared norms."""

    # True: the rule covers the parameters of the module's submodules too (they are not called).
    owns_submodules = False
    # The module's own parameters the rule's math is about (None: not checked).
    param_names: tuple[str, ...] | None = ("weight", "bias")
    # True: the layer works row by row over the leading dims of its first input (Linear, LayerNorm,
    # Embedding), so a batch on any of them is moved to dim 0 (sequence-first activations).
    moves_batch = False

    def why_not(self, module: nn.Module) -> str | None:
        """Why this module's per-sample norms cannot be computed exactly (None: they can): its
        parameters are not the ones the rule's math is about, or `unsupported` says why."""
        if self.param_names is not None:
            own = dict(module.named_parameters(recurse=False))
            extra = sorted(set(own) - set(self.param_names))
            computed = [n for n in self.param_names if n not in own and isinstance(getattr(module, n, None), torch.Tensor)]
            if computed:
                return (f"its {', '.join(computed)} is computed from other parameters (weight_norm or a parametrization), "
                        f"not a parameter of its own")
            if extra:
                return f"it has parameters {extra} that {type(module).__name__}'s rule does not know"
        return self.unsupported(module)

    def unsupported(self, module: nn.Module) -> str | None:
        """Why this module's per-sample norms cannot be computed exactly, for a layer family's own
        reasons (None: they can)."""
        return None

    def params(self, module: nn.Module) -> list[nn.Parameter]:
        """The trainable parameters whose norms this rule covers."""
        return [p for p in module.parameters(recurse=self.owns_submodules) if p.requires_grad]

    def not_per_sample(self, module: nn.Module, call: Call, output: torch.Tensor, batch: int,
                       model_inputs: set[int]) -> str | None:
        """Why this call is not per-sample for a batch of `batch` samples (None: it is). Default:
        dim 0 of the input and of the output is the batch. `model_inputs` holds the storages of the
        model's own inputs."""
        a = call.arg(0, "input")
        if not isinstance(a, torch.Tensor):
            return "its input is not a tensor"
        if a.dim() == 0 or a.shape[0] != batch or output.dim() == 0 or output.shape[0] != batch:
            return f"its input {list(a.shape)} / output {list(output.shape)} has no batch dim of size {batch}"
        return None

    def batch_operands(self, module: nn.Module, call: Call) -> list[tuple[Any, int | None]]:
        """The call's inputs that must carry the batch, each with the dim it must be on (None: any
        dim, or none the provenance can follow, as long as the input comes from the batch). Default:
        the first input, batch on dim 0."""
        return [(call.arg(0, "input"), 0)]

    def positions(self, module: nn.Module, call: Call, g: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def norm_sq(self, module: nn.Module, pos: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def grad_sketch(self, module: nn.Module, pos: Sequence[torch.Tensor],
                    probe: Callable[[torch.Tensor], torch.Tensor]) -> list["Sketch"] | None:
        """A Sketch per trainable parameter: the sum over samples of the per-sample gradients of one
        call's positions, as a [rows, -1] matrix times `probe(parameter)` (float64 [rows]; see
        `sketch`). None: the rule cannot say (its parameters go unchecked)."""
        return None


class Sketch(NamedTuple):
    """A parameter's gradient sketch from one call. `repeats`: the most terms autograd adds into one
    gradient element outside a GEMM (an embedding row looked up n times), whose rounding in a 16-bit
    gradient grows with it."""

    param: torch.Tensor
    value: torch.Tensor
    repeats: int = 1


def sketch_rows(p: torch.Tensor) -> int:
    """Rows of a parameter's gradient as the sketch sees it: dim 0 (1 for a 0-dim parameter)."""
    return p.shape[0] if p.dim() else 1


def sketch(grad: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """A gradient (any shape, its parameter's) as a [rows, -1] matrix times the probe r, float64."""
    rows = grad.shape[0] if grad.dim() else 1
    return (grad.reshape(rows, -1).to(r.dtype) @ r).double()


def _product_sketch(a: torch.Tensor, g: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """sketch(Σ_{b,t} g_bt a_btᵀ, r) = Gᵀ(A r) for a [..., d], g [..., p]: no [p, d] product formed."""
    ar = a.reshape(-1, a.shape[-1]).to(r.dtype) @ r
    return (g.reshape(-1, g.shape[-1]).to(r.dtype).T @ ar).double()


def _ids_sketch(ids: torch.Tensor, g: torch.Tensor, r: torch.Tensor, rows: int,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """sketch of an embedding table's gradient: row ids[t] gets g_t (times scale[t])."""
    ids = ids.reshape(-1)
    vals = g.reshape(ids.shape[0], -1).to(r.dtype) @ r
    if scale is not None:
        vals = vals * scale
    return torch.zeros(rows, dtype=r.dtype, device=vals.device).index_add_(0, ids, vals).double()


def _repeats(ids: torch.Tensor, table: torch.Tensor) -> int:
    """How often the most frequent id occurs, where a 16-bit table's gradient rounds each add (one
    host read); 1 otherwise."""
    if table.dtype not in (torch.float16, torch.bfloat16) or not ids.numel():
        return 1
    return int(torch.unique(ids.reshape(-1), return_counts=True)[1].max())


def _trainable(p: torch.Tensor | None) -> bool:
    return p is not None and p.requires_grad


def _bias_sq(g: torch.Tensor) -> torch.Tensor:
    return g.sum(1, dtype=_backend.product_dtype(g)).square().sum(1)


def _operand(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """x as an operand of the norm products: kept as it is when the products sum it in `acc`
    anyway (16-bit tensors with float32 sums: no float32 copy of an activation), else cast."""
    return x if _backend.product_dtype(x) == acc else x.to(acc)


# -------------------------------------------------------------------- Linear-like products
def use_ghost(t: int, d: int, p: int) -> bool:
    """Ghost norm (Grams, B·T²·(d+p) FLOPs) when it is cheaper than the direct form (B·T·d·p)."""
    return t * (d + p) < d * p


def _ghost(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return _backend.ghost_norm_sq(a, g)


def _direct(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return _backend.direct_norm_sq(a, g)


def product_norm_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """||Σ_t g_t a_tᵀ||²_F per sample for a [B, T, d] and g [B, T, p]."""
    t, d, p = a.shape[1], a.shape[2], g.shape[2]
    if t == 1:
        a, g = a.to(_backend.product_dtype(a)), g.to(_backend.product_dtype(g))
        return a.square().sum((1, 2)) * g.square().sum((1, 2))
    return _ghost(a, g) if use_ghost(t, d, p) else _direct(a, g)


@register_norm_rule(nn.Linear)
class LinearRule(NormRule):
    moves_batch = True

    def positions(self, module, call, g, acc):
        a, b = call.arg(0, "input"), g.shape[0]
        if g.dtype in (torch.float16, torch.bfloat16) and a.dtype != g.dtype:
            # Autocast ran F.linear on this 16-bit cast of the input: the exact operand of the weight
            # gradient (and a 16-bit pair keeps the products on tensor cores, with float32 sums).
            a = a.to(g.dtype)
        return _operand(a, acc).reshape(b, -1, a.shape[-1]), _operand(g, acc).reshape(b, -1, g.shape[-1])

    def norm_sq(self, module, pos):
        a, g = pos
        dtype = torch.promote_types(_backend.product_dtype(a), _backend.product_dtype(g))
        out = torch.zeros(g.shape[0], dtype=dtype, device=g.device)
        if _trainable(module.weight):
            out = out + product_norm_sq(a, g)
        if _trainable(module.bias):
            out = out + _bias_sq(g)
        return out

    def grad_sketch(self, module, pos, probe):
        a, g = pos
        out = []
        if _trainable(module.weight):
            out.append(Sketch(module.weight, _product_sketch(a, g, probe(module.weight))))
        if _trainable(module.bias):
            out.append(Sketch(module.bias, sketch(g.sum((0, 1), dtype=_backend.product_dtype(g)), probe(module.bias))))
        return out

    def bookkept_norm_sq(self, module, g: torch.Tensor, weight_sq: torch.Tensor | None) -> torch.Tensor:
        """Squared norms of a book-kept call (gapmon.bookkeeping): the weight part formed with the
        weight gradient, plus the bias part from the output gradient g [B, T, p]."""
        out = torch.zeros(g.shape[0], dtype=_backend.product_dtype(g), device=g.device)
        if weight_sq is not None:
            out = out + weight_sq
        if _trainable(module.bias):
            out = out + _bias_sq(g)
        return out


def _unfold(x: torch.Tensor, module: _torch_compat.ConvNdBase) -> torch.Tensor:
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

    def not_per_sample(self, module, call, output, batch, model_inputs):
        a = call.arg(0, "input")
        if isinstance(a, torch.Tensor) and a.dim() == len(module.kernel_size) + 1:
            return "its input is unbatched"
        return super().not_per_sample(module, call, output, batch, model_inputs)

    def positions(self, module, call, g, acc):
        a, b, groups = call.arg(0, "input"), g.shape[0], module.groups
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

    def grad_sketch(self, module, pos, probe):
        cols, grads = pos
        groups = module.groups
        b, length = grads.shape[0] // groups, grads.shape[1]
        grads = grads.reshape(b, groups, length, -1)
        out = []
        if _trainable(module.weight):  # weight [out, C/G, k...]: group j's rows pair with group j's columns
            r = probe(module.weight)
            ar = cols.reshape(b, groups, length, -1).to(r.dtype) @ r  # [B, G, L]
            out.append(Sketch(module.weight, torch.einsum("bglo,bgl->go", grads.to(r.dtype), ar).reshape(-1).double()))
        if _trainable(module.bias):
            out.append(Sketch(module.bias, sketch(grads.sum((0, 2)).reshape(-1), probe(module.bias))))
        return out


# -------------------------------------------------------------------- embeddings
@register_norm_rule(nn.Embedding)
class EmbeddingRule(NormRule):
    param_names = ("weight",)
    moves_batch = True

    def positions(self, module, call, g, acc):
        b = g.shape[0]
        ids = call.arg(0, "input").reshape(b, -1)
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
        return _backend.embedding_norm_sq(ids, g, padding)

    def grad_sketch(self, module, pos, probe):
        if not _trainable(module.weight):
            return []
        ids, g = pos
        flat = ids.reshape(-1)
        scale = torch.ones(flat.shape, dtype=torch.float64, device=g.device)
        if module.padding_idx is not None:  # autograd leaves the padding row's gradient alone
            scale = scale.masked_fill(flat == module.padding_idx % module.num_embeddings, 0.0)
        if module.scale_grad_by_freq:  # autograd divides by the id's count in the whole call, not per sample
            scale = scale / torch.bincount(flat, minlength=module.num_embeddings)[flat].double()
        r = probe(module.weight)
        return [Sketch(module.weight, _ids_sketch(flat, g, r, module.num_embeddings, scale.to(r.dtype)), _repeats(flat, module.weight))]


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

    def grad_sketch(self, module, pos, probe):
        xhat, g = pos
        out = []
        for name, total in (("weight", lambda: (g * xhat).sum((0, 1))), ("bias", lambda: g.sum((0, 1)))):
            p = getattr(module, name, None)
            if _trainable(p):
                out.append(Sketch(p, sketch(total(), probe(p))))
        return out


@register_norm_rule(nn.LayerNorm, nn.RMSNorm)
class LastDimsNormRule(_AffineNormRule):
    moves_batch = True

    def positions(self, module, call, g, acc):
        a, shape = call.arg(0, "input"), tuple(module.normalized_shape)
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
    def positions(self, module, call, g, acc):
        xhat = F.group_norm(call.arg(0, "input").to(acc), module.num_groups, eps=module.eps)
        return _channels_last_positions(xhat), _channels_last_positions(g.to(acc))


@register_norm_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
class InstanceNormRule(_AffineNormRule):
    def unsupported(self, module):
        if module.track_running_stats:
            return "track_running_stats=True (eval mode normalises with running statistics)"
        return None

    def positions(self, module, call, g, acc):
        xhat = F.instance_norm(call.arg(0, "input").to(acc), eps=module.eps)
        return _channels_last_positions(xhat), _channels_last_positions(g.to(acc))


# -------------------------------------------------------------------- bags
@register_norm_rule(nn.EmbeddingBag)
class EmbeddingBagRule(NormRule):
    """Sample b's bag adds c_t·g_b to row id_t for each entry t of the bag (c_t: its per-sample weight
    in "sum" mode, 1 / the bag's size in "mean" mode; 0 for padding_idx). As positions: ids [B, L] and
    per-entry gradients c_t·g_b, which the Embedding product then pairs by equal id."""

    param_names = ("weight",)

    def unsupported(self, module):
        if module.mode == "max":
            return "mode='max' (its gradient follows the arg max of each dimension)"
        if module.scale_grad_by_freq:
            # On torch 2.13 CPU the scaled gradient of a row is not 1 / its own count in the bag
            # ([1, 2, 2, 5, 2]: row 5 gets g / 3), so no per-id rule reproduces it.
            return "scale_grad_by_freq=True (its gradient follows no per-id frequency rule here)"
        return None

    def batch_operands(self, module, call):
        ids = call.arg(0, "input")  # 1-D ids with offsets: one bag per sample, the ids from the batch
        return [(ids, 0 if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None)]

    def not_per_sample(self, module, call, output, batch, model_inputs):
        ids = call.arg(0, "input")
        if not isinstance(ids, torch.Tensor) or ids.dim() not in (1, 2):
            return "its input is not a 1-D or 2-D tensor of ids"
        if output.dim() != 2 or output.shape[0] != batch:
            return f"it makes {output.shape[0] if output.dim() else 0} bags for a batch of {batch}"
        return None

    def positions(self, module, call, g, acc):
        ids, offsets = call.arg(0, "input"), call.arg(1, "offsets")
        weights = call.arg(2, "per_sample_weights")
        if ids.dim() == 1:  # bags are segments of ids, starting at offsets
            n = ids.shape[0]
            starts = offsets[:-1] if module.include_last_offset else offsets
            ends = offsets[1:] if module.include_last_offset else torch.cat((offsets[1:], offsets.new_tensor([n])))
            width = int((ends - starts).max()) if starts.numel() else 0
            index = starts.unsqueeze(1) + torch.arange(width, device=ids.device)
            valid = index < ends.unsqueeze(1)
            index = index.clamp(max=max(n - 1, 0))
            ids = ids[index] if n else ids.new_zeros(index.shape)
            weights = weights[index] if weights is not None else None
        else:
            valid = torch.ones_like(ids, dtype=torch.bool)
        if module.padding_idx is not None:
            valid &= ids != module.padding_idx
        coef = valid.to(acc) if weights is None else weights.to(acc) * valid
        if module.mode == "mean":
            coef = coef / valid.sum(1, keepdim=True).clamp(min=1).to(acc)
        return ids.masked_fill(~valid, 0), g.to(acc).unsqueeze(1) * coef.unsqueeze(2)

    def norm_sq(self, module, pos):
        ids, g = pos
        if not _trainable(module.weight):
            return torch.zeros(g.shape[0], dtype=g.dtype, device=g.device)
        return _backend.embedding_norm_sq(ids, g, -1)  # padding entries already have zero coefficients

    def grad_sketch(self, module, pos, probe):
        if not _trainable(module.weight):
            return []
        ids, g = pos
        return [Sketch(module.weight, _ids_sketch(ids, g, probe(module.weight), module.num_embeddings), _repeats(ids, module.weight))]


# -------------------------------------------------------------------- attention
@register_norm_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(NormRule):
    """nn.MultiheadAttention reads its in/out projection weights directly (out_proj's forward never
    runs), so the rule recomputes the attention from the call's inputs with explicit projection
    outputs q, k, v and context c, and takes their gradients for the output gradient G by autograd.
    Then each projection is a Linear product: in_proj rows [q; k; v] by ghost/direct form against
    the query/key/value inputs, out_proj against c, biases as sums over positions. The in_proj
    rows of q, k and v are disjoint, so their squared norms add."""

    owns_submodules = True
    param_names = None

    def unsupported(self, module):
        if not _torch_compat.mha_same_embed_dim(module):
            return "separate kdim/vdim projections"
        if module.bias_k is not None or module.add_zero_attn:
            return "add_bias_kv / add_zero_attn"
        if module.dropout > 0:
            return f"attention dropout {module.dropout} (the recomputed attention would draw another mask)"
        return None

    def batch_operands(self, module, call):
        dim = 0 if module.batch_first else 1
        return [(call.arg(i, n), dim) for i, n in enumerate(("query", "key", "value"))]

    def not_per_sample(self, module, call, output, batch, model_inputs):
        q = call.arg(0, "query")
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            return "its query is unbatched"
        dim = 0 if module.batch_first else 1
        if q.shape[dim] != batch:
            return f"its query {list(q.shape)} has no batch dim of size {batch}"
        return None

    def positions(self, module, call, g, acc):
        query, key, value = call.arg(0, "query"), call.arg(1, "key"), call.arg(2, "value")
        key_padding_mask, attn_mask = call.arg(3, "key_padding_mask"), call.arg(5, "attn_mask")
        is_causal = call.arg(7, "is_causal", False)
        if not module.batch_first:  # [T, B, E] -> [B, T, E]; the output gradient comes batch-first too
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
            g = g.transpose(0, 1)
        x = [t.to(acc) for t in (query, key, value)]
        e, h = module.embed_dim, module.num_heads
        w = module.in_proj_weight.detach().to(acc)
        bias = module.in_proj_bias.detach().to(acc) if module.in_proj_bias is not None else None
        with torch.enable_grad():
            proj = [F.linear(x[i], w[i * e:(i + 1) * e], None if bias is None else bias[i * e:(i + 1) * e])
                    .requires_grad_() for i in range(3)]
            b, t, s = proj[0].shape[0], proj[0].shape[1], proj[1].shape[1]
            heads = [p.reshape(b, p.shape[1], h, e // h).transpose(1, 2) for p in proj]
            mask = _attention_mask(key_padding_mask, attn_mask, is_causal, b, h, t, s, acc, query.device)
            ctx = F.scaled_dot_product_attention(*heads, attn_mask=mask).transpose(1, 2).reshape(b, t, e)
            g = g.to(acc)
            g_ctx = g.matmul(module.out_proj.weight.detach().to(acc))  # out = ctx W_oᵀ + b_o
            g_proj = torch.autograd.grad(ctx, proj, g_ctx)
        return (*x, *g_proj, ctx.detach(), g)

    def norm_sq(self, module, pos):
        xq, xk, xv, gq, gk, gv, ctx, g = pos
        out = torch.zeros(g.shape[0], dtype=g.dtype, device=g.device)
        if _trainable(module.in_proj_weight):
            out = out + sum(product_norm_sq(a, gr) for a, gr in ((xq, gq), (xk, gk), (xv, gv)))
        if _trainable(module.in_proj_bias):
            out = out + _bias_sq(gq) + _bias_sq(gk) + _bias_sq(gv)
        if _trainable(module.out_proj.weight):
            out = out + product_norm_sq(ctx, g)
        if _trainable(module.out_proj.bias):
            out = out + _bias_sq(g)
        return out

    def grad_sketch(self, module, pos, probe):
        xq, xk, xv, gq, gk, gv, ctx, g = pos
        out = []
        w, bias, w_out, b_out = module.in_proj_weight, module.in_proj_bias, module.out_proj.weight, module.out_proj.bias
        if _trainable(w):  # rows [q; k; v]
            r = probe(w)
            out.append(Sketch(w, torch.cat([_product_sketch(x, gx, r) for x, gx in ((xq, gq), (xk, gk), (xv, gv))])))
        if _trainable(bias):
            out.append(Sketch(bias, sketch(torch.cat([gx.sum((0, 1)) for gx in (gq, gk, gv)]), probe(bias))))
        if _trainable(w_out):
            out.append(Sketch(w_out, _product_sketch(ctx, g, probe(w_out))))
        if _trainable(b_out):
            out.append(Sketch(b_out, sketch(g.sum((0, 1)), probe(b_out))))
        return out


def _attention_mask(key_padding_mask, attn_mask, is_causal, b, h, t, s, dtype, device):
    """nn.MultiheadAttention's masks (True = masked out, or additive floats) as one additive SDPA mask."""
    if attn_mask is None and key_padding_mask is None and not is_causal:
        return None
    mask = torch.zeros(b, h, t, s, dtype=dtype, device=device)
    if is_causal and attn_mask is None:
        attn_mask = torch.ones(t, s, dtype=torch.bool, device=device).triu(1)
    for m, shape in ((attn_mask, None), (key_padding_mask, (b, 1, 1, s))):
        if m is None:
            continue
        add = torch.zeros_like(m, dtype=dtype).masked_fill(m, float("-inf")) if m.dtype == torch.bool else m.to(dtype)
        if shape is not None:
            add = add.reshape(shape)
        elif add.dim() == 3:  # [B·heads, T, S]
            add = add.reshape(b, h, t, s)
        mask = mask + add
    return mask
