"""Linear layers whose parent passes their parameters to an op itself, never calling the layer: torchvision's Swin
(`F.linear(x, self.qkv.weight, self.qkv.bias)` in `shifted_window_attention`), timm's BEiT and EVA
(`F.linear(x, self.qkv.weight, qkv_bias)`).

Each covered nn.Linear's weight and bias are followed in every collected forward pass as free parameters are
(free_parameters.ParameterUses), except inside the layer's own forward, where its rule follows them. A micro-batch
that never called the layer takes the per-sample gradients those uses read as the layer's norms, or leaves the layer
out, named, when one of them is a use the tracking cannot follow. In one that also called it, the rule's norms stand
and the use check refuses them if a use outside the forward added to the gradient (use_check).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..utils import is_dtensor
from .batch_provenance import Shared
from .free_parameters import ParameterUses
from .rules import LinearRule


class FunctionalLinearUses:
    """The uses outside their own forward of the covered nn.Linear layers' parameters (a LayerCoverage's layers whose
    rule is Linear's, their parameters not tied to another layer's)."""

    def __init__(self, coverage: Any, checker: Any, state: Any):
        self.coverage, self.checker, self.state = coverage, checker, state
        self.layers: dict[int, tuple[str, nn.Module]] = {}  # layer index -> (name, module)
        for index, (name, module, rule) in enumerate(coverage.layers):
            if type(rule) is LinearRule and name not in coverage.ties:
                self.layers[index] = (name, module)
        self._by_module = {id(module): index for index, (_, module) in self.layers.items()}
        self._handles = [h for _, module in self.layers.values() for h in (
            module.register_forward_pre_hook(self._enter), module.register_forward_hook(self._leave))]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def follow(self, mb: Any, tracker: Any) -> None:
        """Starts micro-batch `mb`'s following of every such layer's trainable parameters (plain tensors only: a
        DTensor's uses are left to the use check)."""
        for index, (name, module) in self.layers.items():
            if name in self.coverage.skipped:
                continue
            for attr in ("weight", "bias"):
                p = getattr(module, attr, None)
                if isinstance(p, torch.Tensor) and p.requires_grad and not is_dtensor(p):
                    mb.functional[(index, attr)] = uses = ParameterUses(mb.batch)
                    uses.follow(p, tracker, self.checker, name)

    def _enter(self, module: nn.Module, args) -> None:
        """The layer's own forward begins: its rule follows its parameters there, not the tracking."""
        tracking = self.state.tracking
        if tracking is not None and self.state.collecting and self.state.micro:
            for p in module.parameters(recurse=False):
                tracking.mark(p, None)

    def _leave(self, module: nn.Module, args, output) -> None:
        """The layer's own forward ended: its parameters are followed again outside it."""
        tracking = self.state.tracking
        if tracking is None or not self.state.collecting or not self.state.micro:
            return
        index = self._by_module.get(id(module))
        functional = self.state.micro[-1].functional
        for attr in ("weight", "bias"):
            uses = functional.get((index, attr))
            if uses is not None and uses.param is not None and getattr(module, attr, None) is uses.param:
                tracking.mark(uses.param, Shared(uses.piece(uses.param)))

    def finish(self, micro: list) -> None:
        """Adds each micro-batch's norms of the layers its forward used only through their parameters; leaves out, by
        name, a layer also called in it, or one whose parameters went into an op the tracking does not follow."""
        for mb in micro:
            used: dict[int, list[tuple[str, ParameterUses]]] = {}
            for (index, attr), uses in mb.functional.items():
                if uses.per_sample is not None or uses.escaped:
                    used.setdefault(index, []).append((attr, uses))
            for index, parts in used.items():
                self._finish_layer(mb, index, parts)
            mb.functional = {}

    def _finish_layer(self, mb: Any, index: int, parts: list[tuple[str, ParameterUses]]) -> None:
        name, module = self.layers[index]
        if name in self.coverage.skipped:
            return
        if index in mb.used:  # called too: its rule's norms stand, and the use check refuses them if a use outside
            return            # its forward added to the gradient (as it does for a weight read by another module)
        escaped = next((uses.escaped for _, uses in parts if uses.escaped), None)
        if escaped is not None:
            self.coverage.skip(name, f"its parent passes its parameters to {escaped}, which the batch tracking does "
                                     "not follow (its forward never runs: a functional use)")
            return
        layer_type = self.coverage.type_of(name, module)
        with torch.no_grad():
            for _, uses in parts:
                g = uses.per_sample
                mb.add(g.square().sum(1), g.dtype, layer_type, name)
                self.checker.explain_gradient(uses.param, name, g.sum(0).reshape(uses.param.shape), uses.rounding)
