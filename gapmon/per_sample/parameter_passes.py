"""Which backward passes give the covered parameters their gradients.

`loss.backward()` does: the layers' gradient hooks act at once. A pass taken for another tensor's gradient
(`torch.autograd.grad(loss, x)` of an input, as adversarial training and saliency take; `backward(inputs=[x])`)
may not, and its hooks see gradients that reach no parameter (unless create_graph=True: then they act, and a
second pass through the forward is refused by name): their work waits until the pass ends, and is
done for the layers whose parameters got gradients in it (`torch.autograd.grad(loss, params)`), dropped for
the others, whose micro-batch is marked (MicroBatch.input_gradient_pass: its forward served an input's gradient
alone, and is left out when its layers got none else)."""
from __future__ import annotations

import functools
from typing import Callable

import torch

from .. import _torch_compat
from .micro_batch import MicroBatch


class ParameterPasses:
    """Shared by the layers' gradient hooks (accumulating, wait) and the covered parameters' (reached)."""

    def __init__(self) -> None:
        self._task, self._accumulates = -2, True  # the pass last asked about, and whether it accumulates
        self._waiting: dict[int, list[tuple[list[torch.Tensor], Callable[[], None], MicroBatch]]] = {}
        self._reached: set[tuple[int, int]] = set()  # (pass, parameter id): a covered parameter's gradient in it

    def accumulating(self, params: list[torch.Tensor] | None) -> bool:
        """Whether the pass running now accumulates the parameters' gradients (asked of autograd once a pass, of the
        first layer's first parameter), or takes them with create_graph=True: the layers' hooks act at once."""
        task = _torch_compat.graph_task_id()
        if task != self._task:
            self._task = task
            # (A pass with create_graph=True is acted on: its gradient is differentiated again, a gradient penalty
            # whose backward runs through the forward a second time, refused by name when the norms are read.)
            self._accumulates = not params or torch.is_grad_enabled() or _torch_compat.accumulates_gradient(params[0])
        return self._accumulates

    def wait(self, params: list[torch.Tensor], work: Callable[[], None], mb: MicroBatch) -> None:
        """`work` waits for the end of the pass running now, done there if one of `params` got its gradient in it."""
        task = _torch_compat.graph_task_id()
        if task not in self._waiting:
            self._waiting[task] = []
            _torch_compat.at_end_of_backward(functools.partial(self._settle, task))
        self._waiting[task].append((params, work, mb))

    def reached(self, p: torch.Tensor) -> None:
        """A covered parameter's gradient hook: p got a gradient in the pass running now."""
        if self._waiting:
            self._reached.add((_torch_compat.graph_task_id(), id(p)))

    def _settle(self, task: int) -> None:
        reached = {pid for t, pid in self._reached if t == task}
        self._reached = {r for r in self._reached if r[0] != task}
        for params, work, mb in self._waiting.pop(task, []):
            if any(id(p) in reached for p in params):
                work()
            else:
                mb.input_gradient_pass = True
