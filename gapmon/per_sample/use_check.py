"""Uses of a covered parameter outside its layer's forward (`F.linear(h, self.tok.weight)`, a layer's weight
read by another module): a hook on every covered parameter sketches the gradient autograd accumulates for
it, and each rule sketches the sum of the per-sample gradients it saw (the same random probe,
NormRule.grad_sketch). Norms are refused when the two differ by more than the gradient's rounding
(USE_CHECK_RTOL): the parameter got contributions no rule saw."""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any

import torch
import torch.nn as nn

from .. import _torch_compat
from ..utils import is_dtensor
from .micro_batch import Collection
from .rules import NormRule, add_sketch, sketch_rows

# Relative difference between a parameter's accumulated gradient and the sum of the per-sample
# gradients the rules saw (both sketched) above which the parameter had uses no rule saw; by the
# least precise dtype involved (bf16 autocast rounds the weight-gradient GEMM to 2^-9, whose
# sketches then differ by ~2e-3). A missed contribution smaller than this passes unseen.
USE_CHECK_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


class UseCheck:
    """Sketches of one parameter's gradient: accumulated by autograd, and explained by the rules."""

    def __init__(self, name: str, layer: str, rows: int, device: torch.device, dtype: torch.dtype):
        self.name, self.layer = name, layer
        # Summed in the probe's dtype (float32, float64 for a float64 parameter): each sketch then adds in one op, and
        # float32's rounding of a few sums (~1e-7) stays far below the float32 tolerance (1e-4).
        self.total, self.explained = torch.zeros(2, rows, dtype=dtype, device=device)
        self.rtol = USE_CHECK_RTOL[torch.float64]
        self.repeats = 1
        self.unchecked: str | None = None  # why it cannot be checked (a rule without a sketch, a DTensor gradient)

    def widen(self, dtype: torch.dtype, repeats: int = 1) -> None:
        """Allows the rounding of `dtype`; a 16-bit gradient that adds `repeats` terms into one
        element outside a GEMM (an embedding row) rounds each add: its error grows as sqrt(repeats)."""
        rtol = USE_CHECK_RTOL.get(dtype, USE_CHECK_RTOL[torch.float32])
        if dtype in (torch.float16, torch.bfloat16):
            rtol *= max(1.0, math.sqrt(repeats))
        self.rtol = max(self.rtol, rtol)
        self.repeats = max(self.repeats, repeats)


class UseChecker:
    """The gradient hooks, probes and sketches of the covered parameters (keyed by parameter identity)."""

    def __init__(self, state: Collection):
        self.state = state
        self.param_names: dict[int, str] = {}
        self.hooks: dict[int, Any] = {}  # id(parameter) -> handle of its gradient hook
        self.probes: dict[int, torch.Tensor] = {}  # id(parameter) -> its random probe
        self.checks: dict[int, UseCheck] = {}  # id(parameter) -> sketches since the last reset
        self._hooked_state: tuple | None = None

    def forget(self, param_names: dict[int, str]) -> None:
        """Drops what was keyed by the old parameter objects (they were replaced) and takes their names."""
        self.close()
        self.param_names = param_names
        self.probes, self.checks, self._hooked_state = {}, {}, None

    def hook_covered(self, layers: list[tuple[str, nn.Module, NormRule]], trainable_state: tuple) -> None:
        """Hooks the gradient of every covered trainable parameter, so that a use the rules never see
        (its layer's forward never ran) is counted too. Looked at again only when requires_grad changed."""
        if trainable_state == self._hooked_state:
            return
        self._hooked_state = trainable_state
        for name, module, rule in layers:
            for p in rule.params(module):
                self.watch(p, name)

    def watch(self, p: torch.Tensor, layer: str) -> None:
        """Hooks parameter p's gradient (once). A weak reference: the hook lives on the parameter and
        must not keep it alive."""
        if id(p) not in self.hooks:
            self.hooks[id(p)] = p.register_hook(functools.partial(self._accumulated, weakref.ref(p), layer))

    def probe(self, p: torch.Tensor) -> torch.Tensor:
        """The fixed random probe of parameter p (one per parameter, drawn once, seeded)."""
        r = self.probes.get(id(p))
        if r is None:
            dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            gen = torch.Generator(device=p.device).manual_seed(0x9E3779B9 + len(self.probes))
            width = p.numel() // max(sketch_rows(p), 1) if p.numel() else 0
            r = self.probes[id(p)] = torch.randn(width, generator=gen, dtype=dtype, device=p.device)
        return r

    def check(self, p: torch.Tensor, layer: str) -> UseCheck:
        check = self.checks.get(id(p))
        if check is None:
            name = self.param_names.get(id(p), f"{layer} parameter {list(p.shape)}")  # FSDP2: unsharded parameters
            check = self.checks[id(p)] = UseCheck(name, layer, sketch_rows(p), p.device, self.probe(p).dtype)
            check.widen(p.dtype)
        return check

    def _accumulated(self, ref: weakref.ref, layer: str, grad: torch.Tensor) -> None:
        """Gradient hook of a covered parameter: sketches what autograd accumulates for it."""
        p = ref()
        if (not self.state.collecting or grad is None or p is None or p.numel() == 0
                or _torch_compat.functorch_transforms_active()):
            return
        check = self.check(p, layer)
        if is_dtensor(grad):
            check.unchecked = "its gradient is a DTensor"
            return
        with torch.no_grad():
            if grad.layout == torch.sparse_coo:  # Embedding(sparse=True)
                grad = grad.coalesce()
                r = self.probe(p)
                vals = grad.values().reshape(grad.values().shape[0], -1).to(r.dtype) @ r
                check.total.index_add_(0, grad.indices()[0], vals)
            else:
                add_sketch(check.total, grad, self.probe(p))
        check.widen(grad.dtype, check.repeats)

    def explain(self, name: str, module: nn.Module, rule: NormRule, used: list[torch.Tensor] | None, piece: tuple,
                dtype: torch.dtype, grads: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Adds the sum over samples of one call's per-sample gradients (sketched) to its parameters: to
        the parameter objects the forward used (under FSDP2 the module may hold other ones by now). `grads`:
        (parameter, that sum) of every trainable parameter when the norms formed them on the way (then they are
        sketched, and the positions are not read again), else the rule's grad_sketch reads the positions."""
        now = rule.params(module)
        used = now if used is None else used
        as_used = {id(p): u for p, u in zip(now, used)} if len(used) == len(now) else {}
        probe = lambda p: self.probe(as_used.get(id(p), p))  # noqa: E731
        if grads is not None:  # one matrix-vector op each, into the check
            for p, grad in grads:
                check = self.check(as_used.get(id(p), p), name)
                add_sketch(check.explained, grad, probe(p))
                check.widen(dtype)
            return
        sketches = rule.grad_sketch(module, piece, probe)
        if sketches is None:
            for p in used:
                self.check(p, name).unchecked = f"{type(rule).__name__} gives no grad_sketch"
            return
        for p, s, repeats in sketches:
            check = self.check(as_used.get(id(p), p), name)
            check.explained += s
            check.widen(dtype, repeats)

    def refuse_unseen_uses(self, skipped: set[str]) -> None:
        """Raises RuntimeError naming the covered parameters whose gradient got contributions that no
        rule saw (the parameter was used outside its layer's forward): their norms would be wrong."""
        # Parameters of layers found not to be per-sample are out of the norms already.
        checks = [c for c in self.checks.values() if c.unchecked is None and c.layer not in skipped]
        if not checks:
            return
        with torch.no_grad():  # a few multi-tensor ops, not three norms per parameter
            totals, explained = [c.total for c in checks], [c.explained for c in checks]
            wide = torch.float64  # the norms of float32 and float64 sums, compared in float64
            diff = torch.stack(_torch_compat.foreach_norm(_torch_compat.foreach_sub(totals, explained), wide))
            size = torch.maximum(torch.stack(_torch_compat.foreach_norm(totals, wide)),
                                 torch.stack(_torch_compat.foreach_norm(explained, wide)))
            bad = (diff > size * torch.tensor([c.rtol for c in checks], dtype=torch.float64, device=diff.device))
            bad = bad.cpu().tolist()  # one device-to-host read
        if not any(bad):
            return
        rel = (diff / size.clamp(min=torch.finfo(torch.float64).tiny)).cpu().tolist()
        named = [f"{c.name} (relative difference {r:.2g})" for c, r, b in zip(checks, rel, bad) if b]
        raise RuntimeError(
            f"PerSampleGradNorms: the gradient of {', '.join(named)} has contributions that "
            "no per-sample rule saw: the parameter is used outside its layer's forward (e.g. F.linear(h, "
            "self.tok.weight), or a layer's weight read by another module), so its per-sample norms would be wrong "
            "and none are returned. Call the layer itself (tie weights by sharing the module), or freeze the "
            "parameter.")

    def close(self) -> None:
        for handle in self.hooks.values():
            handle.remove()
        self.hooks = {}
