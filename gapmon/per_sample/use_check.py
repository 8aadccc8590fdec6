"""Uses of a covered parameter outside its layer's forward (`F.linear(x, self.a.weight)` beside a call of the layer, a layer's weight
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
from ..stats import _backend
from ..stats.layout import STAT_NAMES
from ..utils import is_dtensor
from .micro_batch import Collection
from .parameter_passes import ParameterPasses
from .rules import NormRule, add_sketch, sketch_rows

# Relative difference between a parameter's accumulated gradient and the sum of the per-sample
# gradients the rules saw (both sketched) above which the parameter had uses no rule saw; by the
# least precise dtype involved (bf16 autocast rounds the weight-gradient GEMM to 2^-9, whose
# sketches then differ by ~2e-3). A missed contribution smaller than this passes unseen.
USE_CHECK_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


# From this many checks on one device, their norms come from one statistics pass (gapmon's multi-tensor op: float64
# sums, one launch) rather than three multi-tensor norms (whose CPU form is a loop of per-tensor norms: 150 checks
# ~3x slower, 25 checks ~2x faster, measured on the 2-core VM).
_ONE_PASS_FROM = 64


def _difference_and_size(totals: list[torch.Tensor], explained: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 [n]: ||total - explained|| and max(||total||, ||explained||) of each check's sketches."""
    diffs = _torch_compat.foreach_sub(totals, explained)
    if len(totals) >= _ONE_PASS_FROM and len({t.device for t in totals}) == 1:
        n = len(totals)
        norms = _backend.multi_rows(totals + explained + diffs)[:, STAT_NAMES.index("norm")].view(3, n)
        return norms[2], torch.maximum(norms[0], norms[1])
    wide = torch.float64  # the norms of float32 and float64 sums, compared in float64
    return (torch.stack(_torch_compat.foreach_norm(diffs, wide)),
            torch.maximum(torch.stack(_torch_compat.foreach_norm(totals, wide)),
                          torch.stack(_torch_compat.foreach_norm(explained, wide))))


def _max_keeping_nan(a: float, b: float) -> float:
    """max(a, b), NaN when either is (torch.maximum's rule)."""
    if a != a or b != b:
        return math.nan
    return a if a >= b else b


class UseCheck:
    """Sketches of one parameter's gradient: accumulated by autograd, and explained by the rules. Kept from step to
    step for the same parameter object (UseChecker.check: its sums zeroed, its tolerance reset), so that a step's
    hooks find it made."""

    def __init__(self, p: torch.Tensor, name: str, layer: str, probe: torch.Tensor):
        self.ref, self.rows, self.probe = weakref.ref(p), sketch_rows(p), probe
        # Summed in the probe's dtype (float32, float64 for a float64 parameter): each sketch then adds in one op, and
        # float32's rounding of a few sums (~1e-7) stays far below the float32 tolerance (1e-4).
        self.sums = torch.zeros(2, self.rows, dtype=probe.dtype, device=p.device)
        self.total, self.explained = self.sums.unbind(0)
        self.arena: SketchArena | None = None  # the arena whose buffer holds the sums (from the next step on)
        self.restart(name, layer)

    def restart(self, name: str, layer: str) -> None:
        """A new step: nothing sketched yet (the sums are zeroed by the caller), float64's tolerance."""
        self.name, self.layer = name, layer
        self.rtol = USE_CHECK_RTOL[torch.float64]
        self.repeats = 1
        self.widened: tuple = ()  # (dtype, repeats) of the last widen: the same again changes nothing
        self.unchecked: str | None = None  # why it cannot be checked (a rule without a sketch, a DTensor gradient)
        self.seen_by_rule = False  # whether a rule explained a call of its layer this step
        # Gradients a rule handed to autograd itself (book-keeping), not sketched yet: the one that reaches the
        # parameter's hook as the very same tensor was its whole gradient there, the same on both sides.
        self.returned: list[torch.Tensor] = []
        self.sketched = False  # whether either side got a sketch (one whose gradients all came back unchanged has none)

    def explain_returned(self) -> None:
        """Sketches the returned gradients that did not reach the hook unchanged into the explained side."""
        for grad in self.returned:
            add_sketch(self.explained, grad, self.probe)
            self.sketched = True
        self.returned = []

    def fits(self, p: torch.Tensor, probe: torch.Tensor) -> bool:
        """Whether this check is parameter p's (the same object, still of its rows, with its probe now)."""
        return self.ref() is p and self.rows == sketch_rows(p) and self.probe is probe

    def widen(self, dtype: torch.dtype, repeats: int = 1) -> None:
        """Allows the rounding of `dtype`; a 16-bit gradient that adds `repeats` terms into one
        element outside a GEMM (an embedding row) rounds each add: its error grows as sqrt(repeats)."""
        if self.widened == (dtype, repeats):
            return
        self.widened = (dtype, repeats)
        rtol = USE_CHECK_RTOL.get(dtype, USE_CHECK_RTOL[torch.float32])
        if dtype in (torch.float16, torch.bfloat16):
            rtol *= max(1.0, math.sqrt(repeats))
        self.rtol = max(self.rtol, rtol)
        self.repeats = max(self.repeats, repeats)


class SketchArena:
    """The sums of the checks kept from step to step, as slices of one buffer per (device, dtype): zeroed in one op a
    step, and compared in one pass with one host read (`differences`), not in multi-tensor ops over every check (on
    the CPU a loop of per-tensor ops: ~0.2-0.4 ms a step for a small model). Built once a step's comparison is done
    (or at the next step's start) from the checks alive then: a check made later is compared alone in its first step
    and joins the arena built after it."""

    def __init__(self, checks: list[UseCheck]):
        groups: dict[tuple, list[UseCheck]] = {}
        for c in checks:
            groups.setdefault((c.sums.device, c.sums.dtype), []).append(c)
        self.buffers: list[tuple[torch.Tensor, list[UseCheck], torch.Tensor]] = []
        for (device, dtype), members in groups.items():
            buffer = torch.zeros(2, sum(c.rows for c in members), dtype=dtype, device=device)
            start = 0
            for c in members:
                c.sums = buffer[:, start:start + c.rows]
                c.total, c.explained = c.sums.unbind(0)
                c.arena = self
                start += c.rows
            self.buffers.append((buffer, members, torch.tensor([c.rows for c in members], device=device)))
        self.size = len(checks)

    def zero_(self) -> None:
        for buffer, _, _ in self.buffers:
            buffer.zero_()

    def differences(self) -> dict[int, tuple[float, float]]:
        """id(check) -> (||total - explained||, max(||total||, ||explained||)) of every member, float64 norms of the
        sums (one pass per buffer, one host read per device: a GPU step waits for it once, not once per dtype)."""
        by_device: dict[torch.device, list[tuple[list[UseCheck], torch.Tensor]]] = {}
        for buffer, members, rows in self.buffers:
            wide = buffer.to(torch.float64)
            squares = torch.stack((wide[0] - wide[1], wide[0], wide[1]), dim=1).square_()  # [rows, 3]
            norms = torch.segment_reduce(squares, "sum", lengths=rows, axis=0).sqrt_()  # [members, 3]
            by_device.setdefault(buffer.device, []).append((members, norms))
        out: dict[int, tuple[float, float]] = {}
        for parts in by_device.values():
            values = iter(torch.cat([norms for _, norms in parts]).cpu().tolist())
            for c, (d, t, e) in zip((c for members, _ in parts for c in members), values):
                out[id(c)] = (d, _max_keeping_nan(t, e))
        return out


class RuleProbes:
    """What a rule's grad_sketch reads the probes through: called with a parameter, its probe; `factors(p)`, the
    (u, v) of a probe drawn as an outer product (NormRule.factored_probe), else None. `as_used`: the parameter objects
    the forward used, by id of the module's (FSDP2)."""

    def __init__(self, checker: "UseChecker", layer: str, as_used: dict[int, torch.Tensor]):
        self.checker, self.layer, self.as_used = checker, layer, as_used

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        return self.checker.check(self.as_used.get(id(p), p), self.layer).probe

    def factors(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        self(p)  # (drawn now if it was not yet)
        return self.checker.factors.get(id(self.as_used.get(id(p), p)))


class UseChecker:
    """The gradient hooks, probes and sketches of the covered parameters (keyed by parameter identity)."""

    def __init__(self, state: Collection):
        self.state = state
        self.param_names: dict[int, str] = {}
        self.hooks: dict[int, Any] = {}  # id(parameter) -> handle of its gradient hook
        self.probes: dict[int, torch.Tensor] = {}  # id(parameter) -> its random probe
        self.factored: set[int] = set()  # ids of 3-D parameters whose probe is an outer product (NormRule.factored_probe)
        self.factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(parameter) -> (u, v) of its probe u ⊗ v
        self.checks: dict[int, UseCheck] = {}  # id(parameter) -> the checks this step touched
        self._kept: dict[int, UseCheck] = {}  # id(parameter) -> its check of an earlier step (UseCheck.fits)
        self._arena: SketchArena | None = None  # the kept checks' sums
        self._hooked_state: tuple | None = None
        # Layer -> the group whose largest gradient scales its checks' differences (a layer's own name by default):
        # the free parameters of one module that overrides a ruled layer's forward (timm's LayerNorm: weight and bias).
        self.scale_groups: dict[str, str] = {}
        self.passes = ParameterPasses()  # which backward passes give the covered parameters gradients

    def forget(self, param_names: dict[int, str]) -> None:
        """Drops what was keyed by the old parameter objects (they were replaced) and takes their names."""
        self.close()
        self.param_names = param_names
        self.probes, self.checks, self._kept, self._hooked_state, self._arena = {}, {}, {}, None, None
        self.factored, self.factors = set(), {}

    def new_step(self) -> None:
        """Starts the sketches over: the checks of the last step are kept for their parameters (those still alive),
        their sums zeroed in one multi-tensor op."""
        kept = {**self._kept, **self.checks}
        self._kept = {key: c for key, c in kept.items() if c.ref() is not None}
        self.checks = {}
        with torch.no_grad():
            if any(c.arena is None or c.arena is not self._arena for c in self._kept.values()) or (
                    self._arena is not None and self._arena.size != len(self._kept)):
                self._arena = SketchArena(list(self._kept.values())) if self._kept else None  # its sums start at zero
            elif self._arena is not None:
                self._arena.zero_()

    def hook_covered(self, layers: list[tuple[str, nn.Module, NormRule]], trainable_state: tuple) -> None:
        """Hooks the gradient of every covered trainable parameter, so that a use the rules never see
        (its layer's forward never ran) is counted too. Looked at again only when requires_grad changed."""
        if trainable_state == self._hooked_state:
            return
        self._hooked_state = trainable_state
        for name, module, rule in layers:
            for p in rule.params(module):
                self.watch(p, name, rule.factored_probe)

    def watch(self, p: torch.Tensor, layer: str, factored: bool = False) -> None:
        """Hooks parameter p's gradient (once). A weak reference: the hook lives on the parameter and
        must not keep it alive. `factored`: its rule reads a 3-D parameter's probe as an outer product."""
        if factored and p.dim() == 3:
            self.factored.add(id(p))
        if id(p) not in self.hooks:
            self.hooks[id(p)] = p.register_hook(functools.partial(self._accumulated, weakref.ref(p), layer))

    def probe(self, p: torch.Tensor) -> torch.Tensor:
        """The fixed random probe of parameter p (one per parameter, drawn once, seeded; drawn again when the
        parameter object's data changed width, device or float64-ness: `p.data = ...`, `model.to(...)`)."""
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        width = p.numel() // max(sketch_rows(p), 1) if p.numel() else 0
        r = self.probes.get(id(p))
        if r is None or r.shape[0] != width or r.dtype != dtype or r.device != p.device:
            gen = torch.Generator(device=p.device).manual_seed(0x9E3779B9 + len(self.probes))
            if id(p) in self.factored and p.dim() == 3:
                # u ⊗ v over the last two dims: E[(uᵀ D v)²] = ||D||², as a dense probe's, and a rule sketches Σ gᵀ R a
                # as (g·u)(a·v), not through a product with R.
                u, v = (torch.randn(n, generator=gen, dtype=dtype, device=p.device) for n in p.shape[1:])
                self.factors[id(p)] = (u, v)
                r = self.probes[id(p)] = torch.outer(u, v).reshape(-1)
            else:
                self.factors.pop(id(p), None)
                r = self.probes[id(p)] = torch.randn(width, generator=gen, dtype=dtype, device=p.device)
        return r

    def check(self, p: torch.Tensor, layer: str) -> UseCheck:
        """Parameter p's check of this step: its check of the last step started over (sums zeroed by new_step),
        or a new one."""
        key = id(p)
        check = self.checks.get(key)
        if check is not None:
            return check
        name = self.param_names.get(key) or f"{layer} parameter {list(p.shape)}"  # FSDP2: unsharded parameters
        check, probe = self._kept.pop(key, None), self.probe(p)
        if check is not None and check.fits(p, probe):
            check.restart(name, layer)
        else:
            check = UseCheck(p, name, layer, probe)
        check.widen(p.dtype)
        self.checks[key] = check
        return check

    def _accumulated(self, ref: weakref.ref, layer: str, grad: torch.Tensor) -> None:
        """Gradient hook of a covered parameter: sketches what autograd accumulates for it."""
        if not self.state.collecting or grad is None:
            return
        p = ref()
        if p is None or p.numel() == 0 or _torch_compat.functorch_transforms_active():
            return
        self.passes.reached(p)
        check = self.check(p, layer)
        if check.returned:
            for i, mine in enumerate(check.returned):
                if grad is mine:  # the gradient a rule returned, alone and unchanged: it explains itself exactly
                    del check.returned[i]
                    return
            check.explain_returned()  # summed with other contributions by autograd: both sides sketched
        check.sketched = True
        if type(grad) is not torch.Tensor and is_dtensor(grad):
            check.unchecked = "its gradient is a DTensor"
            return
        if grad.layout == torch.sparse_coo:  # Embedding(sparse=True)
            with torch.no_grad():
                grad = grad.coalesce()
                vals = grad.values().reshape(grad.values().shape[0], -1).to(check.probe.dtype) @ check.probe
                check.total.index_add_(0, grad.indices()[0], vals)
        elif torch.is_grad_enabled():  # a backward with create_graph=True: the sketch stays out of its graph
            with torch.no_grad():
                add_sketch(check.total, grad, check.probe)
        else:
            add_sketch(check.total, grad, check.probe)
        check.widen(grad.dtype, check.repeats)

    def explain(self, name: str, module: nn.Module, rule: NormRule, used: list[torch.Tensor] | None, piece: tuple,
                dtype: torch.dtype, grads: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                returned: bool = False) -> None:
        """Adds the sum over samples of one call's per-sample gradients (sketched) to its parameters: to
        the parameter objects the forward used (under FSDP2 the module may hold other ones by now). `grads`:
        (parameter, that sum) of every trainable parameter when the norms formed them on the way (then they are
        sketched, and the positions are not read again), else the rule's grad_sketch reads the positions.
        `returned`: the `grads` are the tensors the rule's backward hands to autograd (book-keeping); one that
        reaches its parameter's hook as the same object is that gradient whole, and neither side is sketched."""
        now = rule.params(module)
        as_used: dict[int, torch.Tensor] = {}
        if used is not None and len(used) == len(now) and any(u is not q for u, q in zip(used, now)):
            as_used = {id(q): u for q, u in zip(now, used)}
        if rule.compute_dtype is not None and USE_CHECK_RTOL.get(rule.compute_dtype, 0) > USE_CHECK_RTOL.get(dtype, 0):
            dtype = rule.compute_dtype
        if grads is not None:  # one matrix-vector op each, into the check
            for p, grad in grads:
                self.explain_gradient(as_used.get(id(p), p), name, grad, dtype, returned)
            return
        sketches = rule.grad_sketch(module, piece, RuleProbes(self, name, as_used))
        if sketches is None:
            for p in (now if used is None else used):
                self.check(p, name).unchecked = f"{type(rule).__name__} gives no grad_sketch"
            return
        for p, s, repeats in sketches:
            check = self.check(as_used.get(id(p), p), name)
            check.explained += s
            check.sketched = True
            check.widen(dtype, repeats)
            check.seen_by_rule = True

    def explain_gradient(self, p: torch.Tensor, layer: str, grad: torch.Tensor, dtype: torch.dtype,
                         returned: bool = False) -> None:
        """Adds `grad`, the sum over samples of parameter p's per-sample gradients (a rule's, or a free parameter's),
        to p's explained side: sketched now, or, `returned` (handed to autograd as it is), kept for its hook."""
        check = self.check(p, layer)
        if returned:
            check.returned.append(grad)
        else:
            add_sketch(check.explained, grad, check.probe)
            check.sketched = True
        check.widen(dtype)
        check.seen_by_rule = True

    def unseen_uses(self, skipped: set[str]) -> dict[str, tuple[str, bool]]:
        """{layer: (why, whether a rule saw part of it)} of the layers whose parameters got gradient contributions no
        rule saw, to be left out of the norms (PerSampleGradNorms skips them and takes back what they added;
        strict=True refuses): a parameter used
        outside its layer's forward as well as in it (F.linear(x, self.a.weight) beside a call of the layer, a layer's
        weight read by another module), whose per-sample norms would be wrong, or a layer whose parameters got
        gradients while no call of it was seen (used only functionally: F.linear(x, layer.weight), a fused kernel
        taking the weights), which added nothing.

        A parameter's difference is judged against the larger of its own gradient's size and its layer's largest
        (a key projection's bias gets a gradient that cancels to rounding noise: softmax ignores it; so does a
        normalisation's bias before `pool(y) - y`, PoolFormer's mixer), the free parameters of a module that overrides
        a ruled layer's forward counting as one layer (scale_groups)."""
        for c in self.checks.values():  # returned gradients whose hook never came (the parameter's is elsewhere)
            c.explain_returned()
        # Parameters of layers found not to be per-sample are out of the norms already; a parameter whose gradients
        # all came back as the rule returned them has nothing to compare.
        checks = [c for c in self.checks.values() if c.unchecked is None and c.layer not in skipped and c.sketched]
        if not checks:
            return {}
        with torch.no_grad():
            diff, size = self._differences(checks)
            self._gather_into_arena()
        # A parameter's difference against the larger of its own size and its layer's largest (NaN kept, as a NaN
        # gradient is not a use no rule saw).
        layer_size: dict[str, float] = {}
        groups = [self.scale_groups.get(c.layer, c.layer) for c in checks]
        for group, v in zip(groups, size):
            layer_size[group] = _max_keeping_nan(layer_size.get(group, v), v)
        scale = [_max_keeping_nan(v, layer_size[group]) for group, v in zip(groups, size)]
        partly: dict[str, list[str]] = {}
        unseen: dict[str, list[str]] = {}
        for c, d, s in zip(checks, diff, scale):
            if d > s * c.rtol:
                if c.seen_by_rule:
                    partly.setdefault(c.layer, []).append(
                        f"{c.name} (relative difference {d / max(s, torch.finfo(torch.float64).tiny):.2g})")
                else:
                    unseen.setdefault(c.layer, []).append(c.name)
        why = {layer: (f"the gradient of {', '.join(names)} has contributions that no per-sample rule saw: the "
                       "parameter is used outside its layer's forward as well (e.g. F.linear(x, self.a.weight), or a "
                       "layer's weight read by another module), so its per-sample norms would be wrong. Call the layer "
                       "itself (tie weights by sharing the module), or freeze the parameter", True)
               for layer, names in partly.items()}
        for layer, names in unseen.items():
            why.setdefault(layer, (f"its parameters {names} got gradients while its forward never ran: they are used "
                                   "functionally (F.linear(x, layer.weight), a fused kernel taking the weights)", False))
        return why

    def _gather_into_arena(self) -> None:
        """After a step's comparison, its checks and the kept ones into a new arena when some are not in the current
        one (the first step, a new parameter): their sums are spent, so they may move (and start at zero)."""
        live = {**self._kept, **self.checks}
        if any(c.arena is None or c.arena is not self._arena for c in live.values()):
            self._arena = SketchArena([c for c in live.values() if c.ref() is not None])

    def _differences(self, checks: list[UseCheck]) -> tuple[list[float], list[float]]:
        """||total - explained|| and max(||total||, ||explained||) of each check: from the arena when it holds them all
        (every step after the first), else from multi-tensor ops over the checks."""
        if self._arena is not None and all(c.arena is self._arena for c in checks):
            found = self._arena.differences()
            return [found[id(c)][0] for c in checks], [found[id(c)][1] for c in checks]
        diff, size = _difference_and_size([c.total for c in checks], [c.explained for c in checks])
        return diff.cpu().tolist(), size.cpu().tolist()

    def close(self) -> None:
        for handle in self.hooks.values():
            handle.remove()
        self.hooks = {}
