"""Which forward passes of the watched model belong to the training step.

A forward pass run with gradients off inside a monitored step (an evaluation, a rollout, a reference pass of
the same model, as TRL's DPO takes with a PEFT adapter disabled) is not one of the step's: its activations
are not the global batch's. Reentrant checkpointing of the whole model also runs its first pass without
gradients; backward then runs that pass again, and the recomputation is counted in its place."""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import _torch_compat
from ..per_sample.micro_batch import SET_ASIDE_KEPT
from ..utils import input_storages


class StepForwards:
    """Hooks on `model` and its direct children (a loop may call a child itself: a LightningModule's training_step
    calling `self.model(...)`) that say whether the forward pass running now counts for the step; the outermost of
    them decides (one called inside another's forward is part of it)."""

    def __init__(self, model: nn.Module):
        self.without_grad = False  # the forward pass running now has gradients off: not the step's
        self.recounting = False  # backward recomputes a forward that ran without gradients: counted now
        self._depth = 0  # watched forwards running now, one inside another
        self._set_aside: list[set[int]] = []
        self._handles = [handle for module in (model, *model.children())
                         for handle in (module.register_forward_pre_hook(self._starts, with_kwargs=True),
                                        module.register_forward_hook(self._ends, always_call=True))]

    def _starts(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():  # a compiled forward is the step's (no flag is read in compiled code)
            return
        self._depth += 1
        if self._depth > 1:  # inside the outermost watched forward, which decided
            return
        if _torch_compat.in_backward():
            storages = input_storages(args, kwargs)
            self.recounting = bool(storages) and any(storages <= kept for kept in self._set_aside)
        elif not torch.is_grad_enabled():
            self.without_grad = True
            self._set_aside = [*self._set_aside[1 - SET_ASIDE_KEPT:], input_storages(args, kwargs)]

    def _ends(self, module: nn.Module, args: tuple, output) -> None:
        if torch.compiler.is_compiling():
            return
        self._depth = max(self._depth - 1, 0)
        if not self._depth:
            self.without_grad = self.recounting = False

    def new_step(self) -> None:
        self._set_aside = []

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
