"""The activation side of GAPMonitor: forward hooks on every module fold each output, and a tensor hook
each output's gradient, into one preallocated device accumulator with one fused op per call
(gapmon::accumulate_instance_stats), with the forward/backward order that NaN localisation reads and the
modules that returned another module's output (read once, reported for both)."""
from __future__ import annotations

import functools
import math
import sys
import weakref
from typing import Any

import torch
import torch.nn as nn

from .. import _torch_compat
from ..stats import ops
from ..stats.block_formats import format_codes
from ..stats.layout import ACC_NAMES, BLOCK_COLUMNS, NUMERICS_COLUMNS
from ..utils import first_tensor, is_dtensor

ACTIVATION_KINDS = ("activations", "activation_grads")


def _untraced_grad_hook():
    """ActivationRecorder._grad_hook, kept out of Dynamo's trace, where the running torch needs it (else
    False; None before Dynamo is loaded). torch 2.11's Dynamo rewrites a hook on an intermediate tensor
    into an autograd Function and fails once the tensor has a symbolic size (dynamic shapes, also those
    Dynamo turns on by itself after a batch of another size: "referenced nonexistent value s95"). A hook
    it may not trace is registered eagerly at a graph break instead, and is exact; the compiled model is
    then split at every module whose output gradient is measured (on that torch only).
    Looked up from begin_step, outside any compiled region, once Dynamo is loaded (torch.compile loads
    it; gapmon never imports it)."""
    if "torch._dynamo" not in sys.modules:
        return None
    if not _torch_compat.dynamo_apply_backward_hook_bug():
        return False  # this torch's Dynamo traces such hooks correctly
    return _torch_compat.dynamo_disable(ActivationRecorder._grad_hook)


class BlockRowsAccumulator:
    """Per (kind, module) row, the per-block format rows (gapmon.stats.block_formats) of the step's
    activations or activation gradients, merged over the micro-batches (each tensor cast with its own
    scales, as a recipe casts each call's tensor), and their element counts. The rows are merged in place by
    the activation hook's op (accumulate_instance_stats_numerics_blocks), in the pass that takes the statistics."""

    def __init__(self, formats: tuple[str, ...], rows: int):
        self.formats, self.rows = formats, rows
        self.codes = format_codes(formats)
        self.table: torch.Tensor | None = None  # [rows, F, C]
        self.numels: torch.Tensor | None = None  # [rows]

    def reset(self, device: torch.device | None = None) -> None:
        device = device or (self.table.device if self.table is not None else torch.device("cpu"))
        with torch.inference_mode(False):
            self.table = torch.zeros(self.rows, len(self.formats), len(BLOCK_COLUMNS), dtype=torch.float64, device=device)
            self.table[..., BLOCK_COLUMNS.index("min_nonzero")] = math.inf
            self.numels = torch.zeros(self.rows, dtype=torch.float64, device=device)

    def table_for(self, x: torch.Tensor) -> torch.Tensor:
        """The table, on x's device (a new one on the first tensor of a step, or of a new device)."""
        if self.table is None or self.table.device != x.device:
            self.reset(x.device)
        return self.table


class ActivationRecorder:
    """Per-instance statistics (and, with `numerics`, numerics rows) of the outputs of `modules`
    ((name, module) pairs) and of their gradients, accumulated over the micro-batches of a monitored step.

    Rows [0, M) of the accumulator take the activations, rows [M, 2M) their gradients."""

    def __init__(self, modules: list[tuple[str, nn.Module]], activations: bool, activation_grads: bool,
                 correction: int, numerics: bool, block_formats: tuple[str, ...] = (), forwards: Any = None):
        self.modules = modules
        self.forwards = forwards  # a StepForwards: which forward passes are the step's (None: every one)
        self.kinds = (activations, activation_grads)
        self.correction, self.numerics = correction, numerics
        self.blocks = BlockRowsAccumulator(block_formats, 2 * len(modules)) if block_formats else None
        self.active = False
        self.acc: torch.Tensor | None = None
        self.num_acc: torch.Tensor | None = None  # [2M, C] numerics rows of the activations, then their gradients
        self._grad_rows: list[torch.Tensor] = []
        self._num_rows: list[torch.Tensor] = []  # one-row views of num_acc, one per (kind, module)
        self._untraced_grad_hook = None  # see _untraced_grad_hook
        self.first_seen = [[-1] * len(modules), [-1] * len(modules)]  # forward, backward order
        self._order = [0, 0]
        # A tensor that several modules output (an MLP and its `down` projection) is read once: the
        # outer module's hook finds the inner one's output and reports the inner module's statistics,
        # provided it is unchanged (same version counter: an in-place ReLU after a Linear is not).
        self._last_output: tuple[weakref.ref, int, int] | None = None
        self.aliases: dict[int, int] = {}  # module index -> the module whose statistics it shares
        self._handles = []
        if activations or activation_grads:
            self._handles = [module.register_forward_hook(functools.partial(self._forward_hook, index))
                             for index, (_, module) in enumerate(modules)]

    @property
    def on(self) -> bool:
        return any(self.kinds)

    def begin(self, model: nn.Module) -> None:
        """Zeroes the accumulator for a monitored step (made on the model's device the first time)."""
        if self._untraced_grad_hook is None:
            self._untraced_grad_hook = _untraced_grad_hook()
        if self.acc is None and self.on:
            first = next(model.parameters(), None)
            device = first.device if first is not None and first.device.type != "meta" else torch.device("cpu")
            self._set_acc(self._new_acc(device, None))
        if self.acc is not None:
            self.acc.zero_()
        if self.num_acc is not None:
            self.num_acc.zero_()
        if self.blocks is not None:
            self.blocks.reset()
        self.first_seen = [[-1] * len(self.modules), [-1] * len(self.modules)]
        self._order = [0, 0]
        self._last_output, self.aliases = None, {}

    def accumulator(self, device: torch.device) -> torch.Tensor:
        """The step's accumulator ([2M, len(ACC_NAMES)]; zeros on `device` if nothing was recorded)."""
        return self.acc if self.acc is not None else self._new_acc(device, None)

    def share_order_with_aliases(self) -> None:
        """Gives each module that output another's tensor that module's place in the order."""
        for index, source in self.aliases.items():
            for order in self.first_seen:
                order[index] = order[source]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._set_acc(None)
        self.active = False

    # ---------------------------------------------------------------- hooks
    def _forward_hook(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if not self.active:
            return
        compiling = torch.compiler.is_compiling()
        if self.forwards is not None and (self.forwards.without_grad if not compiling else not torch.is_grad_enabled()):
            # A forward pass with gradients off (an evaluation): not the step's batch. (Traced, grad mode is read
            # as a guard; a compiled region is never reentrant checkpointing's first pass, which breaks the graph.)
            return
        out = first_tensor(output)
        if out is None or out.dim() <= 1 or not out.is_floating_point() or out.numel() == 0:
            return
        if not compiling:  # eager-only bookkeeping (as the order tracking below)
            version = _torch_compat.version_counter(out)
            last = self._last_output
            if last is not None and last[0]() is out and last[2] == version >= 0:
                if last[1] != index:
                    self.aliases.setdefault(index, last[1])
                return
            self._last_output = (weakref.ref(out), index, version)
        # A forward pass inside backward is activation checkpointing recomputing this module: its
        # activations were counted already (the gradient hooks of exactly one of the passes fire).
        # The check is eager-only: Dynamo cannot trace it (compiled regions are not recomputed by it).
        # (Unless the pass it repeats ran without gradients: the whole model under reentrant checkpointing.)
        recomputing = not compiling and _torch_compat.in_backward() and not (
            self.forwards is not None and self.forwards.recounting)
        if self.kinds[0] and not recomputing:
            self._fold(out, index, 0)
        if self.kinds[1] and out.requires_grad:
            hook = self._grad_hook
            if self._untraced_grad_hook and torch.compiler.is_compiling():
                hook = functools.partial(self._untraced_grad_hook, self)
            out.register_hook(functools.partial(hook, index))

    def _grad_hook(self, index: int, grad: torch.Tensor) -> None:
        if self.active and grad is not None and grad.dim() > 1 and grad.numel() > 0:
            self._fold(grad, index, 1)

    def _fold(self, x: torch.Tensor, index: int, kind: int) -> None:
        """Folds one activation (kind 0) or activation gradient (1) of module `index` into the step's
        accumulator rows: its per-instance statistics and, with numerics on, its numerics row, merged
        in place (micro-batches in order; end_step merges the ranks) by the same op, which reads x
        once (on CUDA, many short instances take two launches). Only gapmon ops on preallocated rows:
        torch.compile traces them into the graph."""
        if is_dtensor(x):  # tensor-parallel activations: the local part (see docs/limits.md)
            x = x.to_local()
        backward = kind == 1
        # Under torch.compile the gradient hooks run in the traced backward, where only their own row
        # of the accumulator is touched (see _set_acc); the device check and order bookkeeping are
        # plain Python state and stay in eager (they would force recompiles). NaN localisation then
        # falls back to module order.
        if not (backward and torch.compiler.is_compiling()):
            if self.acc is None or self.acc.device != x.device:
                self._set_acc(self._new_acc(x.device, self.acc))
        if not torch.compiler.is_compiling() and self.first_seen[kind][index] < 0:
            self.first_seen[kind][index] = self._order[kind]
            self._order[kind] += 1
        acc, row = (self._grad_rows[index], 0) if backward else (self.acc, index)
        numerics_row = self._num_rows[kind * len(self.modules) + index] if self.numerics else None
        if self.blocks is not None:  # the block rows in the same pass
            blocks, blocks_row = self.blocks, kind * len(self.modules) + index
            # (a format scaled per tensor: the op measures x's amax first, a read of its own)
            ops.accumulate_instance_stats_numerics_blocks(x, acc, row, self.correction, numerics_row, 0, blocks.codes,
                                                          None, blocks.table_for(x), blocks_row)
            blocks.numels[blocks_row] += x.numel()
        elif numerics_row is not None:
            ops.accumulate_instance_stats_and_numerics(x, acc, row, self.correction, numerics_row, 0)
        else:
            ops.accumulate_instance_stats(x, acc, row, self.correction)

    def _new_acc(self, device: torch.device, old: torch.Tensor | None) -> torch.Tensor:
        if old is not None and old.abs().sum().item() != 0:
            raise RuntimeError(f"GAPMonitor: activations of one step on two devices ({old.device} and {device})")
        # A normal tensor even when the first step begins under torch.inference_mode (an inference
        # tensor could not be updated by the training steps that follow).
        with torch.inference_mode(False):
            return torch.zeros(2 * len(self.modules), len(ACC_NAMES), dtype=torch.float64, device=device)

    def _set_acc(self, acc: torch.Tensor | None) -> None:
        """Each gradient hook writes through a one-row view of its own: a traced backward (torch.compile)
        then has one input per hook, none shared with the forward graph. (torch 2.11's Dynamo breaks on a
        backward hook whose tensor the forward graph also uses.)"""
        self.acc = acc
        m = len(self.modules)
        self._grad_rows = [] if acc is None else [acc[m + i: m + i + 1] for i in range(m)]
        self.num_acc = None
        if acc is not None and self.numerics:  # the numerics rows live beside the statistics
            with torch.inference_mode(False):
                self.num_acc = torch.zeros(2 * m, len(NUMERICS_COLUMNS), dtype=torch.float64, device=acc.device)
        self._num_rows = [] if self.num_acc is None else [self.num_acc[i: i + 1] for i in range(2 * m)]
