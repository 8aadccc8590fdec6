"""Per-sample gradient norms without per-sample gradients.

For each supported layer the forward hook keeps the layer input A and a tensor hook on the output
receives G = dL/d(output) during backward; the per-sample squared norms of the layer's parameter
gradients follow from A and G in closed form, are added to a per-sample accumulator, and A is
released. Norms cover every parameter of these layers:

- nn.Linear on [B, d] or [B, ..., d]: weight by the ghost norm sum((A Aᵀ) ⊙ (G Gᵀ)) when 2T² < d·p,
  else by the direct ||Gᵀ A||²; bias ||Σ_t G_t||².
- nn.Embedding: sum over positions with equal ids of G_t·G_s (padding_idx rows excluded).
- nn.LayerNorm / nn.RMSNorm: weight ||Σ_t G_t ⊙ x̂_t||², bias ||Σ_t G_t||².

Parameters of other modules are reported by coverage() and excluded with a warning (strict=True
raises). A parameter shared by several modules (tied weights) is refused: its per-sample gradient
is the sum of the pieces, whose norms do not add.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import ops as _ops  # noqa: F401  (loads gapmon._C: the norm ops)
from .utils import clean_name

_SUPPORTED = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)


def _compiled() -> bool:
    return _ops._COMPILED


def _ghost(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if _compiled():
        return torch.ops.gapmon.ghost_norm_sq(a, g)
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))


def _direct(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if _compiled():
        return torch.ops.gapmon.direct_norm_sq(a, g)
    return torch.bmm(g.transpose(1, 2), a).square().sum((1, 2))


def _embedding(ids: torch.Tensor, g: torch.Tensor, padding_idx: int) -> torch.Tensor:
    if _compiled():
        return torch.ops.gapmon.embedding_norm_sq(ids, g, padding_idx)
    same = ids.unsqueeze(2) == ids.unsqueeze(1)
    if padding_idx >= 0:
        valid = ids != padding_idx
        same &= valid.unsqueeze(2) & valid.unsqueeze(1)
    return (torch.bmm(g, g.transpose(1, 2)) * same).sum((1, 2))


def layer_norm_sq(module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-sample squared gradient norm of all parameters of a supported layer, [B] float32+."""
    b = g.shape[0]
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    g = g.to(acc)
    if isinstance(module, nn.Linear):
        a = a.to(acc).reshape(b, -1, a.shape[-1])
        g = g.reshape(b, -1, g.shape[-1])
        t, d, p = a.shape[1], a.shape[2], g.shape[2]
        if t == 1:
            out = a.square().sum((1, 2)) * g.square().sum((1, 2))
        elif 2 * t * t < d * p:
            out = _ghost(a, g)
        else:
            out = _direct(a, g)
        if module.bias is not None:
            out = out + g.sum(1).square().sum(1)
        return out
    if isinstance(module, nn.Embedding):
        ids = a.reshape(b, -1)
        return _embedding(ids, g.reshape(b, ids.shape[1], -1), -1 if module.padding_idx is None else module.padding_idx)
    # LayerNorm / RMSNorm: x̂ recomputed from the input, exactly as the module normalises it.
    shape = tuple(module.normalized_shape)
    if isinstance(module, nn.LayerNorm):
        xhat = F.layer_norm(a.to(acc), shape, eps=module.eps)
    else:
        xhat = F.rms_norm(a.to(acc), shape, eps=module.eps)
    n = 1
    for s in shape:
        n *= s
    g = g.reshape(b, -1, n)
    out = torch.zeros(b, dtype=acc, device=g.device)
    if module.weight is not None:
        out = out + (g * xhat.reshape(b, -1, n)).sum(1).square().sum(1)
    if getattr(module, "bias", None) is not None:
        out = out + g.sum(1).square().sum(1)
    return out


class PerSampleGradNorms:
    """Norms of per-sample gradients of the covered parameters, computed during backward.

    `local_norms()` returns ||∇θ loss_i|| for this rank's samples, in the order the forward passes
    saw them (micro-batches concatenated), where loss_i is sample i's own loss. With
    loss_reduction="mean" the loss is taken to be the mean of per-sample losses over each
    micro-batch (so the gradients are rescaled by the micro-batch size); with "sum", their sum.
    The accumulator restarts at the first forward pass after the norms were read, or on reset().
    """

    def __init__(self, model: nn.Module, loss_reduction: str = "mean", strict: bool = False,
                 process_group: dist.ProcessGroup | None = None):
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"PerSampleGradNorms: loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"PerSampleGradNorms: model must be a torch.nn.Module, got {type(model).__name__}")
        self.loss_reduction = loss_reduction
        self.strict = strict
        self._group = process_group
        owners: dict[int, list[str]] = {}
        names = {id(p): clean_name(n) for n, p in model.named_parameters(remove_duplicate=False)}
        self._layers: list[tuple[str, nn.Module]] = []
        for name, module in model.named_modules(remove_duplicate=False):
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), []).append(clean_name(name) or "<root>")
            if isinstance(module, _SUPPORTED) and any(p.requires_grad for p in module.parameters(recurse=False)):
                self._layers.append((clean_name(name), module))
        tied = {names[i]: mods for i, mods in owners.items() if len(mods) > 1}
        if tied:
            raise ValueError(
                "PerSampleGradNorms: tied parameters (shared by several modules) are not supported, their per-sample "
                f"gradient norms would be wrong: {tied}. Untie them or monitor a model without weight sharing."
            )
        covered_ids = {id(p) for _, m in self._layers for p in m.parameters(recurse=False)}
        self._covered = {names[id(p)]: p.numel() for _, m in self._layers for p in m.parameters(recurse=False)
                         if p.requires_grad}
        self._uncovered = {clean_name(n): p.numel() for n, p in model.named_parameters()
                           if p.requires_grad and id(p) not in covered_ids}
        if self._uncovered:
            message = (f"PerSampleGradNorms: {len(self._uncovered)} parameters ({sum(self._uncovered.values()):,} "
                       f"elements) are in unsupported modules and excluded from the norms: "
                       f"{list(self._uncovered)[:8]}{' ...' if len(self._uncovered) > 8 else ''}")
            if strict:
                raise ValueError(message + " (strict=True)")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        self._handles = [m.register_forward_hook(functools.partial(self._forward_hook, i))
                         for i, (_, m) in enumerate(self._layers)]
        self._root = model.register_forward_pre_hook(self._new_micro_batch)
        self._micro: list[dict[str, Any]] = []  # per micro-batch: batch size and accumulated squares
        self._read = False
        self.skipped: set[str] = set()

    # ------------------------------------------------------------------ hooks
    def _new_micro_batch(self, module, args) -> None:
        if self._read:
            self.reset()
        self._micro.append({"batch": None, "sq": None})

    def _forward_hook(self, index: int, module: nn.Module, args, output) -> None:
        if not self._micro or not args or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        if torch._C._are_functorch_transforms_active():  # e.g. the model run under torch.func.vmap
            return
        a = args[0]
        if not isinstance(a, torch.Tensor) or a.dim() < 1:
            return
        mb = self._micro[-1]
        if mb["batch"] is None:
            mb["batch"] = a.shape[0]
        if a.shape[0] != mb["batch"] or output.shape[0] != mb["batch"]:
            self._skip(self._layers[index][0], f"its input has {a.shape[0]} rows for a micro-batch of {mb['batch']}")
            return
        # The input travels in a one-slot box that the backward hook empties: the reference is dropped
        # as soon as this layer's backward has used it, not when the whole graph is freed.
        output.register_hook(functools.partial(self._backward_hook, module, [a.detach()], mb))

    def _backward_hook(self, module: nn.Module, box: list, mb: dict, g: torch.Tensor) -> None:
        if not box:
            raise RuntimeError(
                "PerSampleGradNorms: a second backward pass through the same forward pass (retain_graph=True) "
                "is not supported: the per-sample gradients of the two passes add, so their norms cannot be "
                "combined. Sum the losses and call backward once."
            )
        a = box.pop()
        with torch.no_grad():
            sq = layer_norm_sq(module, a, g.detach()).double()
            mb["sq"] = sq if mb["sq"] is None else mb["sq"] + sq

    def _skip(self, name: str, why: str) -> None:
        message = f"PerSampleGradNorms: layer '{name}' is not per-sample ({why}); excluded from the norms"
        if self.strict:
            raise RuntimeError(message)
        if name not in self.skipped:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            self.skipped.add(name)

    # ------------------------------------------------------------------ results
    def reset(self) -> None:
        """Forgets the samples seen so far."""
        self._micro = []
        self._read = False

    def local_norms(self) -> torch.Tensor:
        """[B_local] per-sample gradient norms (float32) of this rank's samples since the last reset."""
        self._read = True
        parts = []
        for mb in self._micro:
            if mb["sq"] is None:
                continue
            sq = mb["sq"] * (mb["batch"] ** 2 if self.loss_reduction == "mean" else 1)
            parts.append(sq.sqrt().float())
        if not parts:
            return torch.empty(0)
        return torch.cat(parts)

    def global_norms(self, sample_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, norms) of every rank's samples, ordered by global sample id, each sample once.

        `sample_ids` are the global ids of this rank's samples, in local_norms() order. Ranks that saw
        different samples are all-gathered and reordered (never summed: that would inflate norms by
        sqrt(world size)); samples seen by several ranks (replicated data) appear once.
        """
        norms = self.local_norms()
        ids = torch.as_tensor(sample_ids).reshape(-1).to(torch.int64)
        if ids.numel() != norms.numel():
            raise ValueError(f"PerSampleGradNorms.global_norms: got {ids.numel()} sample ids for {norms.numel()} samples")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self._group) > 1:
            ids, norms = _all_gather_varlen(ids, norms, self._group)
        order = torch.argsort(ids, stable=True)
        ids, norms = ids[order], norms[order]
        keep = torch.ones_like(ids, dtype=torch.bool)
        keep[1:] = ids[1:] != ids[:-1]
        return ids[keep], norms[keep]

    def coverage(self) -> dict[str, Any]:
        """Covered and uncovered parameters (name -> numel), and layers skipped at run time."""
        return {
            "covered": dict(self._covered),
            "uncovered": dict(self._uncovered),
            "covered_numel": sum(self._covered.values()),
            "uncovered_numel": sum(self._uncovered.values()),
            "skipped_layers": sorted(self.skipped),
        }

    def close(self) -> None:
        """Removes the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._root.remove()
        self.reset()


def _all_gather_varlen(ids: torch.Tensor, norms: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gathers per-rank vectors of different lengths (ids and norms packed together)."""
    device = norms.device if norms.device.type != "cpu" or dist.get_backend(group) == "gloo" else torch.device("cuda")
    world = dist.get_world_size(group)
    packed = torch.stack((ids.double(), norms.double())).to(device)  # ids < 2^53 are exact in float64
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([packed.shape[1]], device=device), group=group)
    counts = torch.cat(sizes).tolist()  # one host read for all ranks
    longest = int(max(counts))
    padded = torch.zeros(2, longest, dtype=torch.float64, device=device)
    padded[:, : packed.shape[1]] = packed
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    gathered = torch.cat([p[:, : int(n)] for p, n in zip(parts, counts)], dim=1)
    return gathered[0].to(torch.int64).cpu(), gathered[1].float().cpu()
