"""Linear, convolution and embedding layers whose parent passes their parameters to an op itself, never calling the
layer: torchvision's Swin (`F.linear(x, self.qkv.weight, self.qkv.bias)` in `shifted_window_attention`), timm's BEiT
and EVA (`F.linear(x, self.qkv.weight, qkv_bias)`), Mamba's reference path (`dt_proj.weight @ dt`; its Conv1d's weight
in `F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=channels)`), DeBERTa's relative-position table
(`self.rel_embeddings.weight`, normalised by a LayerNorm and projected: followed_through).

Each covered nn.Linear's, nn.Conv1d/2d's and nn.Embedding's weight and bias are followed in every collected forward pass as free parameters are
(free_parameters.ParameterUses), until the layer's own forward first runs, where its rule takes them over. A
micro-batch that never called the layer takes the per-sample gradients those uses read as the layer's norms, or
leaves the layer out, named, when one of them is a use the tracking cannot follow. In one that also called it, the
rule's norms stand and the use check refuses them if a use outside the forward added to the gradient (use_check).
A layer whose own forward ran in a collected pass is not followed again (no cost per step for the layers models call):
a parent that calls it in one step and passes its weights on in a later one has that use found by the use check, and
the layer left out, named.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..utils import is_dtensor
from .batch_provenance import Shared
from .free_parameters import ParameterUses
from .rules import ConvRule, EmbeddingRule, LinearRule


class FunctionalLinearUses:
    """The uses outside their own forward of the covered nn.Linear, convolution and embedding layers' parameters (a
    LayerCoverage's layers whose rule is Linear's, Conv's or Embedding's, their parameters not tied to another
    layer's)."""

    def __init__(self, coverage: Any, checker: Any, state: Any):
        self.coverage, self.checker, self.state = coverage, checker, state
        self.layers: dict[int, tuple[str, nn.Module]] = {}  # layer index -> (name, module)
        for index, (name, module, rule) in enumerate(coverage.layers):
            if type(rule) in (LinearRule, ConvRule, EmbeddingRule) and name not in coverage.ties:
                self.layers[index] = (name, module)
        # id(module) -> its parameters followed in the micro-batch now, until the layer's own forward first runs
        self._marks: dict[int, list[torch.Tensor]] = {}
        self._called: set[int] = set()  # ids of the modules whose own forward ran in a collected pass: not followed
        self._handles = [module.register_forward_pre_hook(self._enter) for _, module in self.layers.values()]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def follow(self, mb: Any, tracker: Any) -> None:
        """Starts micro-batch `mb`'s following of every such layer's trainable parameters (plain tensors only: a
        DTensor's uses are left to the use check). Their gradients are watched already (as covered parameters)."""
        self._marks = {}
        skipped = self.coverage.skipped
        for index, (name, module) in self.layers.items():
            if name in skipped or id(module) in self._called:
                continue
            marks = []
            for attr in ("weight", "bias"):
                p = getattr(module, attr, None)
                if isinstance(p, torch.Tensor) and p.requires_grad and not is_dtensor(p):
                    mb.functional[(index, attr)] = uses = ParameterUses(mb.batch)
                    uses.param = p
                    tracker.mark(p, Shared(uses.piece(p)))
                    marks.append(p)
            if marks:
                self._marks[id(module)] = marks

    def _enter(self, module: nn.Module, args) -> None:
        """The layer's own forward runs: its rule follows its parameters from now on, not the tracking (a use outside
        it in the same micro-batch, before or after, is the use check's to find)."""
        marks = self._marks.pop(id(module), None)
        tracking = self.state.tracking
        if marks and tracking is not None:
            self._called.add(id(module))
            for p in marks:
                tracking.mark(p, None)

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
