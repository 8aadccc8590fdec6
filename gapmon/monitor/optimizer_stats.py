"""What an optimizer did on a monitored step: per parameter, the update dw = w_after - w_before as it
happened (any optimizer: measured, not derived from its formula), its norm, its ratio to |w_before|, its RMS,
its norm per unit of learning rate, its cosine with -grad, and the norms of Adam's moments (exp_avg,
exp_avg_sq) where the optimizer keeps them. Exact for DTensor (FSDP2) parameters, gradients and states: their
norms merge the shards, their dot products reduce over the mesh.

The weights are copied in the optimizer's step pre-hook of a monitored step only (one copy, released in its
post-hook); skipped steps cost nothing.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..stats import ops
from ..stats.layout import STAT_NAMES
from ..utils import is_dtensor
from .metric_names import update_name

_NORM, _COUNT = STAT_NAMES.index("norm"), STAT_NAMES.index("count")
ADAM_STATES = ("exp_avg", "exp_avg_sq")


def _norms(tensors: list[torch.Tensor]) -> list[float]:
    """The L2 norm of each tensor (of the full tensor for a DTensor), in one multi-tensor pass."""
    if not tensors:
        return []
    return ops.multi_tensor_rows(tensors, 0)[:, _NORM].tolist()


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """<a, b> summed in float64 from products in float32 (or float64: each product rounded once, to 2^-24 of
    itself), over the full tensors for DTensors (the local sums reduced over the mesh): a 0-dim tensor."""
    if b.is_sparse:
        b = b.to_dense()
    if a.dtype in (torch.float16, torch.bfloat16):
        a, b = a.float(), b.float()
    product = (a * b.to(a.dtype)).sum(dtype=torch.float64)
    return product.full_tensor() if is_dtensor(product) else product


def _ratio(a: float, b: float) -> float:
    """a / b as float division of tensors gives it: inf for a > 0 = b, NaN for 0 / 0."""
    return a / b if b != 0 else (math.inf if a > 0 else math.nan)


class OptimizerStats:
    """Hooks `optimizer`'s step to measure the update of every parameter `names` names (id -> name) on the
    steps `arm` opens; `emit(step, metrics)` receives each measured step's metrics."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: Callable[[], dict[int, str]],
                 emit: Callable[[int, dict[str, float]], None]):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"GAPMonitor.watch_optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer, self.names, self.emit = optimizer, names, emit
        self._armed: int | None = None
        self._before: dict[int, torch.Tensor] = {}
        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step)]

    def arm(self, step: int | None) -> None:
        """Measures the next optimizer step as the update of step `step` (None: measures nothing)."""
        self._armed = step
        self._before = {}

    def _params(self) -> list[tuple[str, torch.Tensor, dict[str, Any]]]:
        """(name, parameter, its param group) of the named parameters the optimizer steps."""
        names = self.names()
        return [(names[id(p)], p, group) for group in self.optimizer.param_groups for p in group["params"]
                if id(p) in names]

    def _pre_step(self, optimizer, args, kwargs) -> None:
        if self._armed is None:
            return
        # Every parameter: a closure passed to step() computes the gradients after this hook.
        with torch.no_grad():
            self._before = {id(p): p.detach().clone() for _, p, _ in self._params() if p.requires_grad}

    def _post_step(self, optimizer, args, kwargs) -> None:
        if self._armed is None or not self._before:
            return
        step, before = self._armed, self._before
        self._armed, self._before = None, {}
        params = [(name, p, group) for name, p, group in self._params() if id(p) in before and p.grad is not None]
        with torch.no_grad():
            deltas = [p.detach() - before[id(p)] for _, p, _ in params]
            rows = ops.multi_tensor_rows(deltas, 0) if deltas else None
            norms = rows[:, _NORM].tolist() if rows is not None else []
            counts = rows[:, _COUNT].tolist() if rows is not None else []
            weight_norms = _norms([before[id(p)] for _, p, _ in params])
            grad_norms = _norms([p.grad for _, p, _ in params])
            dots = torch.stack([_dot(d, p.grad) for d, (_, p, _) in zip(deltas, params)]).tolist() if params else []
            states = {key: [(i, self.optimizer.state.get(p, {}).get(key)) for i, (_, p, _) in enumerate(params)]
                      for key in ADAM_STATES}
            state_norms = {key: dict(zip([i for i, t in found if isinstance(t, torch.Tensor)],
                                         _norms([t for _, t in found if isinstance(t, torch.Tensor)])))
                           for key, found in states.items()}
        metrics: dict[str, float] = {}
        for i, (name, _, group) in enumerate(params):
            norm, lr = norms[i], group.get("lr")
            lr = float(lr) if lr is not None else math.nan
            metrics[update_name(name, "norm")] = norm
            metrics[update_name(name, "ratio")] = _ratio(norm, weight_norms[i])  # a zero weight (a bias at init): inf
            metrics[update_name(name, "rms")] = norm / math.sqrt(counts[i]) if counts[i] > 0 else math.nan
            metrics[update_name(name, "norm_per_lr")] = norm / lr if lr > 0 else math.nan
            product = norm * grad_norms[i]
            metrics[update_name(name, "cos_neg_grad")] = -dots[i] / product if product > 0 else math.nan
            for key in ADAM_STATES:
                if i in state_norms[key]:
                    metrics[update_name(name, f"{key}_norm")] = state_norms[key][i]
        self.emit(step, metrics)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._before = {}
