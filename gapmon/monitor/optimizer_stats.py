"""What an optimizer did on a monitored step: per parameter, the update dw = w_after - w_before as it
happened (any optimizer: measured, not derived from its formula), its norm, its ratio to |w_before|, its RMS,
its norm per unit of learning rate, its cosine with -grad, and the norms of Adam's moments (exp_avg,
exp_avg_sq) where the optimizer keeps them. The update, weight and gradient sums come from one fused
multi-tensor pass (gapmon.stats.ops.update_rows: one read of the weights before and after and of the
gradients, in double), the moments' norms from one more. Exact for DTensor (FSDP2) parameters, gradients and
states: their sums add over the mesh.

The weights are copied in the optimizer's step pre-hook of a monitored step only (one copy, released in its
post-hook); skipped steps cost nothing.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..stats import ops
from ..stats.layout import STAT_NAMES
from .metric_names import update_name

_NORM = STAT_NAMES.index("norm")
ADAM_STATES = ("exp_avg", "exp_avg_sq")


def _norms(tensors: list[torch.Tensor]) -> list[float]:
    """The L2 norm of each tensor (of the full tensor for a DTensor), in one multi-tensor pass."""
    if not tensors:
        return []
    return ops.multi_tensor_rows(tensors, 0)[:, _NORM].tolist()


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.is_sparse else grad


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
            # One read of the weights before and after the step and of the gradients (update_sums).
            rows = ops.update_rows([before[id(p)] for _, p, _ in params], [p.detach() for _, p, _ in params],
                                   [_dense(p.grad) for _, p, _ in params]).tolist() if params else []
            states = {key: [(i, self.optimizer.state.get(p, {}).get(key)) for i, (_, p, _) in enumerate(params)]
                      for key in ADAM_STATES}
            state_norms = {key: dict(zip([i for i, t in found if isinstance(t, torch.Tensor)],
                                         _norms([t for _, t in found if isinstance(t, torch.Tensor)])))
                           for key, found in states.items()}
        metrics: dict[str, float] = {}
        for i, (name, _, group) in enumerate(params):
            update_sq, weight_sq, grad_sq, dot, count = rows[i]
            norm, lr = math.sqrt(update_sq), group.get("lr")
            lr = float(lr) if lr is not None else math.nan
            metrics[update_name(name, "norm")] = norm
            metrics[update_name(name, "ratio")] = _ratio(norm, math.sqrt(weight_sq))  # a zero weight (a bias at init): inf
            metrics[update_name(name, "rms")] = norm / math.sqrt(count) if count > 0 else math.nan
            metrics[update_name(name, "norm_per_lr")] = norm / lr if lr > 0 else math.nan
            product = norm * math.sqrt(grad_sq)
            metrics[update_name(name, "cos_neg_grad")] = -dot / product if product > 0 else math.nan
            for key in ADAM_STATES:
                if i in state_norms[key]:
                    metrics[update_name(name, f"{key}_norm")] = state_norms[key][i]
        self.emit(step, metrics)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._before = {}
