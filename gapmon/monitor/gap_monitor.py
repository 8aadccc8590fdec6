"""GAPMonitor: statistics of gradients, activations and parameters at every monitored step.

Activations and activation gradients are folded, inside the hooks, into one preallocated
device buffer with one fused op per hook call (gapmon::accumulate_instance_stats). Parameters
and gradients are measured at `end_step` with one `multi_tensor_stats` over all of them
(DTensors merged exactly across shards, with one collective). Activation sums and maxima are
reduced across ranks with one SUM and one MAX all-reduce, and everything reaches the host in
one device-to-host copy. No `.item()` per metric.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import operator
import sys
import warnings
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _torch_compat
from ..config import MonitorConfig, PerSampleConfig, Schedule, per_sample_option
from ..stats import ops
from ..stats.distributed import dtensor_multi_states, fsdp1_shard_groups
from ..stats.layout import ACC_NAMES, NUM_BINS, NUMERICS_COLUMNS, STAT_NAMES, STATE_NAMES
from ..stats.numerics import merge_numerics_states, numerics_from_rows, numerics_states, sparse_histogram, states_and_numerics
from ..utils import (
    ParameterWatch,
    check_int,
    check_step,
    clean_named,
    first_tensor,
    is_dtensor,
    rank_and_world,
    refuse_complex,
)
from .metric_names import (
    FIELD_COLUMNS,
    GLOBAL_BATCH_SIZE,
    NUMERICS_FIELDS,
    NUMERICS_SHARES,
    metric_name,
    numerics_field,
    parse_metric_name,
    per_sample_norm_name,
)
from .sinks import Sink

logger = logging.getLogger("gapmon")

_ROW = len(STAT_NAMES)  # columns of a statistics row
# Activation accumulator columns (csrc/core/stats_state.h via gapmon.stats): every column is summed
# over ranks except max |x|, which is a max.
_ACC_MAX = ACC_NAMES.index("max_abs")
_ACC_SUMS = tuple(i for i in range(len(ACC_NAMES)) if i != _ACC_MAX)
# (metric name, column of a statistics row)
_STAT_FIELDS = tuple((field, STAT_NAMES.index(column)) for field, column in FIELD_COLUMNS.items())
_COUNT = STAT_NAMES.index("count")
_SUM = {ACC_NAMES[i]: k for k, i in enumerate(_ACC_SUMS)}  # column of each sum in the reduced sums
_MODULE_WIDTH = len(_STAT_FIELDS) + 1  # a per-module row: the fields, then the instance count
_INSTANCES = len(_STAT_FIELDS)
_UNDEFINED_WHEN_EMPTY = ("/mean", "/var")  # metrics a tensor with no elements does not have


def _untraced_grad_hook():
    """GAPMonitor._grad_hook, kept out of Dynamo's trace, where the running torch needs it (else
    None). torch 2.11's Dynamo rewrites a hook on an intermediate tensor into an autograd Function
    and fails once the tensor has a symbolic size (dynamic shapes, also those Dynamo turns on by
    itself after a batch of another size: "referenced nonexistent value s95"). A hook it may not
    trace is registered eagerly at a graph break instead, and is exact; the compiled model is then
    split at every module whose output gradient is measured (on that torch only).
    Looked up from begin_step, outside any compiled region, once Dynamo is loaded (torch.compile
    loads it; gapmon never imports it)."""
    if "torch._dynamo" not in sys.modules:
        return None
    if not _torch_compat.dynamo_apply_backward_hook_bug():
        return False  # this torch's Dynamo traces such hooks correctly
    return _torch_compat.dynamo_disable(GAPMonitor._grad_hook)


def _picker(indices: list[int]):
    """A function that returns [values[i] for i in indices] as a tuple, in C."""
    if not indices:
        return lambda values: ()
    if len(indices) == 1:
        return lambda values: (values[indices[0]],)
    return operator.itemgetter(*indices)


class _Segments:
    """Named float64 segments of one flat device tensor: what end_step reduces over ranks in one
    collective, or copies to the host in one transfer, without offset arithmetic at the call sites."""

    def __init__(self, device: torch.device):
        self.device = device
        self._parts: list[torch.Tensor] = []
        self.spans: dict[str, tuple[int, int]] = {}
        self._size = 0

    def add(self, name: str, values: torch.Tensor) -> None:
        flat = values.reshape(-1).to(self.device, torch.float64)
        self.spans[name] = (self._size, self._size + flat.numel())
        self._size += flat.numel()
        self._parts.append(flat)

    def cat(self) -> torch.Tensor:
        return torch.cat(self._parts) if self._parts else torch.empty(0, dtype=torch.float64, device=self.device)

    def of(self, flat: Any, name: str) -> Any:
        """Segment `name` of `flat` (the tensor cat() made, or the host list of its values)."""
        start, end = self.spans[name]
        return flat[start:end]

    def start(self, name: str) -> int:
        return self.spans[name][0]


def _rows_with_sparse(tensors: list[torch.Tensor], correction: int) -> torch.Tensor:
    """Statistics rows of tensors some of which are sparse COO (nn.Embedding(sparse=True)
    gradients): each sparse one's are those of the dense tensor it stands for, without densifying
    it: the state of its coalesced values merged with the state of its implicit zeros."""
    values = [t.coalesce().values() if t.is_sparse else t for t in tensors]
    states = ops.multi_tensor_states(values)
    implicit = states.new_zeros(states.shape)
    for i, t in enumerate(tensors):
        if t.is_sparse:
            zeros = float(t.numel() - values[i].numel())
            implicit[i, STATE_NAMES.index("count")] = zeros
            implicit[i, STATE_NAMES.index("zeros")] = zeros
    return ops.finalize_rows(ops.merge_states(torch.stack((states, implicit))), correction)


class GAPMonitor:
    """Monitors a model's gradients, activations and parameters every `interval` steps.

    Call `begin_step(step, batch_size)` before the forward passes of a step and `end_step()` after
    the backward passes (before `optimizer.step()`/`zero_grad()`); gradient accumulation over any
    number of micro-batches is fine. `end_step` returns the metrics of the step (empty on skipped
    steps) and sends them to the sinks (rank 0 only).

    Metric names: ``gap/{params|grads|activations|activation_grads}/{name}/{max|mean|var|norm|nonfinite}``.
    Parameter and gradient statistics are those of the full (unsharded) tensors. Activation statistics
    are per instance (dim 0) and then: `max` is the max over instances; `mean`, `var` and `norm` are
    averages over all instances of the global batch (micro-batches and data-parallel ranks); `nonfinite`
    is the total count.

    Args:
        model: the module to watch (plain, DDP, or FSDP2 `fully_shard`ed, 1-D or HSDP mesh).
        interval: measure every `interval` steps (steps where step % interval == 0), or the steps of
            a gapmon.Schedule (every, start, end).
        params, grads, activations, activation_grads: which kinds to measure.
        per_sample_grad_norms: also compute per-sample gradient norms (see gapmon.PerSampleGradNorms):
            True, or a gapmon.PerSampleConfig with their options (loss_reduction, strict, batch_dim, ...).
        bookkeeping: with per_sample_grad_norms, form the weight gradients of direct-form Linear layers
            from their per-sample gradients (see gapmon.per_sample.bookkeeping): the norms cost no extra GEMM.
        sinks: where metrics go: gapmon sinks or callables fn(step, metrics). Default: none (the
            metrics are returned by end_step; nothing is written unless a sink is given).
        process_group: the data-parallel group over which activations are averaged (default: world).
        correction: Bessel correction of the variances (default 1, like torch.var).
        numerics: formats (of gapmon.numerics.FORMATS: "bf16", "fp16", "fp8_e4m3", "fp8_e5m2") whose
            underflow/overflow shares to report for parameters, gradients and the monitored activations
            and activation gradients (over all their elements, micro-batches and ranks), with their kurtosis
            (fields NUMERICS_FIELDS; parameters and gradients in their statistics' pass on CPU, one more
            pass elsewhere), and their exponent histograms summed per kind and layer type (info["numerics_histograms"]: {"grads/Linear": {"e-7": n,
            ...}}; histograms in TensorBoard and W&B), with the elements of each group that under/overflow
            at their tensor's own power-of-two scale (info["numerics_scaled"]: {"grads/Linear": {"fp8_e4m3":
            {"underflow": n, "overflow": n}}}: what a scaled recipe sees). Groups without elements are left
            out. Default: none (no cost).
        numerics_alert: with numerics, warn (naming tensors and step) when a tensor's unscaled underflow
            or overflow share in a format exceeds this fraction; also listed in the sinks' info.

    The options are validated once, into `self.config` (a gapmon.MonitorConfig);
    `GAPMonitor.from_config(model, config)` takes one directly.
    """

    def __init__(
        self,
        model: nn.Module,
        interval: int | Schedule = 1,
        params: bool = True,
        grads: bool = True,
        activations: bool = True,
        activation_grads: bool = True,
        per_sample_grad_norms: bool | PerSampleConfig = False,
        bookkeeping: bool = False,
        sinks: Sequence[Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        correction: int = 1,
        numerics: Sequence[str] = (),
        numerics_alert: float | None = None,
    ):
        config = MonitorConfig(
            schedule=interval, params=params, grads=grads, activations=activations,
            activation_grads=activation_grads, per_sample=per_sample_option(per_sample_grad_norms, bookkeeping, process_group),
            sinks=tuple(sinks or ()), process_group=process_group, correction=correction, numerics=numerics,
            numerics_alert=numerics_alert)
        self._setup(model, config)

    @classmethod
    def from_config(cls, model: nn.Module, config: MonitorConfig) -> "GAPMonitor":
        """A monitor of `model` with the options of `config` (a gapmon.MonitorConfig)."""
        if not isinstance(config, MonitorConfig):
            raise TypeError(f"GAPMonitor.from_config: config must be a gapmon.MonitorConfig, got {type(config).__name__}")
        monitor = cls.__new__(cls)
        cls._setup(monitor, model, config)
        return monitor

    def _setup(self, model: nn.Module, config: MonitorConfig) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"GAPMonitor: model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config
        self.numerics, self.numerics_alert = config.numerics, config.numerics_alert
        self.model = model
        self.correction = config.correction
        self._kinds = {kind: getattr(config, kind) for kind in ("params", "grads", "activations", "activation_grads")}
        activations, activation_grads = config.activations, config.activation_grads
        self._group = config.process_group
        self.sinks: list[Sink] = list(config.sinks)

        # The root module (and a wrapper's inner root, e.g. DDP's `module`) is not an activation source.
        self._modules = [(n, m) for n, m in clean_named(model, model.named_modules(), "modules") if n]
        self._module_types = {n: type(m).__name__ for n, m in self._modules}  # numerics histogram groups
        self._watch = ParameterWatch(model)
        self._derive_params()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        if activations or activation_grads:
            for index, (_, module) in enumerate(self._modules):
                self._handles.append(module.register_forward_hook(functools.partial(self._forward_hook, index)))
        self.per_sample = None
        if config.per_sample is not None:
            from ..per_sample import PerSampleGradNorms

            per_sample = config.per_sample
            if per_sample.process_group is None:  # the monitor's group, unless it names its own
                per_sample = dataclasses.replace(per_sample, process_group=config.process_group)
            self.per_sample = PerSampleGradNorms.from_config(model, per_sample)
            self.per_sample.pause()  # collects from begin_step to end_step of monitored steps

        self._step: int | None = None
        self._active = False
        self._acc: torch.Tensor | None = None
        self._grad_rows: list[torch.Tensor] = []
        self._keys: dict[tuple[str, str], tuple[str, ...]] = {}  # see _metric_keys
        self._untraced_grad_hook = None  # see _untraced_grad_hook
        self._pickers: dict[str, tuple] = {}  # see _picked
        self._batch_size = 0
        self._first_seen = [[-1] * len(self._modules), [-1] * len(self._modules)]  # forward, backward order
        self._order = [0, 0]
        # A tensor that several modules output (an MLP and its `down` projection) is read once: the
        # outer module's hook finds the inner one's output and reports the inner module's statistics,
        # provided it is unchanged (same version counter: an in-place ReLU after a Linear is not).
        self._last_output: tuple[weakref.ref, int, int] | None = None
        self._aliases: dict[int, int] = {}  # module index -> the module whose statistics it shares
        self._num_acc: torch.Tensor | None = None  # [2M, C] numerics rows of the activations, then their gradients
        self._num_rows: list[torch.Tensor] = []  # one-row views of it, one per (kind, module)
        self.nonfinite_report: dict[str, Any] = {}
        self.closed = False

    def _derive_params(self) -> None:
        """What the monitor keeps of the model's parameters: re-derived at a monitored step's begin_step
        when they were replaced (meta-device init then to_empty, load_state_dict(assign=True), assignment)."""
        model = self.model
        self._params = clean_named(model, model.named_parameters(), "parameters")
        if self.config.params or self.config.grads:
            refuse_complex(self._params, "GAPMonitor", "the statistics are of real tensors. Store it as real and "
                           "imaginary parts (torch.view_as_real) or pass params=False, grads=False")
        owner_types = {id(p): type(m).__name__ for _, m in self._modules for p in m.parameters(recurse=False)}
        self._param_types = {n: owner_types.get(id(p), type(model).__name__) for n, p in self._params}
        shard_groups = fsdp1_shard_groups(model)
        self._flat_groups = [shard_groups.get(id(p)) for _, p in self._params]  # FSDP1 flat shards

    # ---------------------------------------------------------------- hooks
    def _forward_hook(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if not self._active:
            return
        out = first_tensor(output)
        if out is None or out.dim() <= 1 or not out.is_floating_point() or out.numel() == 0:
            return
        if not torch.compiler.is_compiling():  # eager-only bookkeeping (as the order tracking below)
            version = _torch_compat.version_counter(out)
            last = self._last_output
            if last is not None and last[0]() is out and last[2] == version >= 0:
                if last[1] != index:
                    self._aliases.setdefault(index, last[1])
                return
            self._last_output = (weakref.ref(out), index, version)
        # A forward pass inside backward is activation checkpointing recomputing this module: its
        # activations were counted already (the gradient hooks of exactly one of the passes fire).
        # The check is eager-only: Dynamo cannot trace it (compiled regions are not recomputed by it).
        recomputing = not torch.compiler.is_compiling() and _torch_compat.in_backward()
        if self._kinds["activations"] and not recomputing:
            self._fold(out, index, 0)
        if self._kinds["activation_grads"] and out.requires_grad:
            hook = self._grad_hook
            if self._untraced_grad_hook and torch.compiler.is_compiling():
                hook = functools.partial(self._untraced_grad_hook, self)
            out.register_hook(functools.partial(hook, index))

    def _grad_hook(self, index: int, grad: torch.Tensor) -> None:
        if self._active and grad is not None and grad.dim() > 1 and grad.numel() > 0:
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
            if self._acc is None or self._acc.device != x.device:
                self._set_acc(self._new_acc(x.device, self._acc))
        if not torch.compiler.is_compiling() and self._first_seen[kind][index] < 0:
            self._first_seen[kind][index] = self._order[kind]
            self._order[kind] += 1
        acc, row = (self._grad_rows[index], 0) if backward else (self._acc, index)
        if self.numerics:
            numerics_row = self._num_rows[kind * len(self._modules) + index]
            ops.accumulate_instance_stats_and_numerics(x, acc, row, self.correction, numerics_row, 0)
        else:
            ops.accumulate_instance_stats(x, acc, row, self.correction)

    def _new_acc(self, device: torch.device, old: torch.Tensor | None) -> torch.Tensor:
        if old is not None and old.abs().sum().item() != 0:
            raise RuntimeError(f"GAPMonitor: activations of one step on two devices ({old.device} and {device})")
        # A normal tensor even when the first step begins under torch.inference_mode (an inference
        # tensor could not be updated by the training steps that follow).
        with torch.inference_mode(False):
            return torch.zeros(2 * len(self._modules), len(ACC_NAMES), dtype=torch.float64, device=device)

    def _set_acc(self, acc: torch.Tensor | None) -> None:
        """Rows [0, M) of the accumulator take the activations, rows [M, 2M) their gradients. Each
        gradient hook writes through a one-row view of its own: a traced backward (torch.compile) then
        has one input per hook, none shared with the forward graph. (torch 2.11's Dynamo breaks on a
        backward hook whose tensor the forward graph also uses.)"""
        self._acc = acc
        m = len(self._modules)
        self._grad_rows = [] if acc is None else [acc[m + i: m + i + 1] for i in range(m)]
        self._num_acc = None
        if acc is not None and self.numerics:  # the numerics rows live beside the statistics
            with torch.inference_mode(False):
                self._num_acc = torch.zeros(2 * m, len(NUMERICS_COLUMNS), dtype=torch.float64, device=acc.device)
        self._num_rows = [] if self._num_acc is None else [self._num_acc[i: i + 1] for i in range(2 * m)]

    # ---------------------------------------------------------------- steps
    def begin_step(self, step: int, batch_size: int | None = None) -> None:
        """Starts step `step` (a non-negative integer); `batch_size` is this rank's number of samples
        in the step (all micro-batches)."""
        self._check_open()
        step = check_step(step, "GAPMonitor.begin_step")
        if self._untraced_grad_hook is None:
            self._untraced_grad_hook = _untraced_grad_hook()
        if batch_size is not None:
            batch_size = check_int(batch_size, "GAPMonitor.begin_step", "batch_size")
        self._step = step
        self._active = self.config.schedule.includes(step)
        if self.per_sample is not None and self._active:
            self.per_sample.start()
        elif self.per_sample is not None:
            self.per_sample.pause()  # skipped steps: its hooks return at once
        if not self._active:
            return
        if self._watch.changed():
            self._derive_params()
        self._batch_size = batch_size or 0
        if self._acc is None and (self._kinds["activations"] or self._kinds["activation_grads"]):
            first = next(self.model.parameters(), None)
            device = first.device if first is not None and first.device.type != "meta" else torch.device("cpu")
            self._set_acc(self._new_acc(device, None))
        if self._acc is not None:
            self._acc.zero_()
        if self._num_acc is not None:
            self._num_acc.zero_()
        self._first_seen = [[-1] * len(self._modules), [-1] * len(self._modules)]
        self._order = [0, 0]
        self._last_output, self._aliases = None, {}

    @property
    def monitoring(self) -> bool:
        """Whether a monitored step is open (between begin_step of a scheduled step and end_step)."""
        return self._active

    def add_samples(self, n: int) -> None:
        """Counts `n` more samples of this rank in the current step, for loops that learn the batch
        size one micro-batch at a time (instead of passing batch_size to begin_step)."""
        n = check_int(n, "GAPMonitor.add_samples", "n")
        if self._active:
            self._batch_size += n

    def end_step(self) -> dict[str, float]:
        """Metrics of the step (after backward, before the optimizer step); {} on skipped steps."""
        self._check_open()
        if self._step is None:
            raise RuntimeError("GAPMonitor.end_step: call begin_step(step, batch_size) before the forward pass")
        step, active = self._step, self._active
        self._step, self._active = None, False
        if self.per_sample is not None:
            self.per_sample.pause()  # until the next begin_step: plain steps cost nothing
        if not active:
            return {}
        metrics, info = self._collect(step)
        if rank_and_world()[0] == 0:
            for sink in self.sinks:
                sink.write(step, metrics, info)
        return metrics

    def _collect(self, step: int) -> tuple[dict[str, float], dict[str, Any]]:
        names: list[tuple[str, str]] = []  # (kind, name) of each statistics row
        tensors: list[torch.Tensor] = []
        groups: list = []
        if self._kinds["params"]:
            names += [("params", n) for n, _ in self._params]
            tensors += [p.detach() for _, p in self._params]
            groups += self._flat_groups
        if self._kinds["grads"]:
            # An FSDP1 rank whose piece of a parameter is empty has no .grad: an empty stand-in keeps
            # the rows of every rank aligned for the merge.
            with_grad = [(n, p.grad if p.grad is not None else p.detach().new_empty(0), g)
                         for (n, p), g in zip(self._params, self._flat_groups)
                         if p.grad is not None or (g is not None and p.requires_grad)]
            names += [("grads", n) for n, _, _ in with_grad]
            tensors += [t for _, t, _ in with_grad]
            groups += [g for _, _, g in with_grad]
        device = tensors[0].device if tensors else (self._acc.device if self._acc is not None else torch.device("cpu"))
        numerics_rows = None  # of the parameters and gradients, when taken in the statistics' pass
        if not tensors:
            rows = torch.empty(0, _ROW, device=device)
        elif self.numerics and not any(t.is_sparse for t in tensors):  # one pass and one collective for both
            states, numerics_rows = states_and_numerics(tensors, groups)
            rows = ops.finalize_rows(states, self.correction)
        elif any(g is not None for g in groups):  # FSDP1 flat shards: merge pieces over their groups
            rows = ops.finalize_rows(dtensor_multi_states(tensors, groups), self.correction)
        else:
            try:
                rows = ops.multi_tensor_rows(tensors, self.correction)
            except TypeError:
                if not any(t.is_sparse for t in tensors):
                    raise
                rows = _rows_with_sparse(tensors, self.correction)

        acc = self._acc if self._acc is not None else self._new_acc(device, None)
        dev = acc.device
        m = len(self._modules)
        sums, maxes = _Segments(dev), _Segments(dev)  # reduced over ranks with SUM and with MAX
        sums.add("acc", acc[:, list(_ACC_SUMS)])
        maxes.add("acc", acc[:, _ACC_MAX])
        sums.add("batch", torch.tensor([float(self._batch_size)], dtype=torch.float64, device=dev))
        if self.per_sample is not None:
            norms = self.per_sample.local_norms().to(dev, torch.float64)
            sums.add("per_sample", torch.stack((norms.sum(), torch.tensor(float(norms.numel()), dtype=torch.float64, device=dev))))
            maxes.add("per_sample", torch.cat((norms.max().reshape(1), (-norms).max().reshape(1))) if norms.numel()
                      else torch.full((2,), -math.inf, dtype=torch.float64, device=dev))
        sums_t, maxes_t = sums.cat(), maxes.cat()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self._group) > 1:
            dist.all_reduce(sums_t, op=dist.ReduceOp.SUM, group=self._group)
            dist.all_reduce(maxes_t, op=dist.ReduceOp.MAX, group=self._group)
        per_module = self._module_values(sums.of(sums_t, "acc").view(2 * m, len(_ACC_SUMS)), maxes.of(maxes_t, "acc"))
        out = _Segments(dev)
        out.add("rows", rows)
        out.add("modules", per_module)
        out.add("batch", sums.of(sums_t, "batch"))
        if self.per_sample is not None:
            out.add("per_sample_sums", sums.of(sums_t, "per_sample"))
            out.add("per_sample_maxes", maxes.of(maxes_t, "per_sample"))
        numerics = self._numerics_on_device(names, tensors, groups, out, numerics_rows) if self.numerics else None
        host = out.cat().cpu().tolist()  # the one device-to-host copy

        rows_at = tuple((kind, name, out.start("rows") + i * _ROW) for i, (kind, name) in enumerate(names))
        keys, picks = self._picked("tensors", rows_at, [col for _, col in _STAT_FIELDS])
        metrics: dict[str, float] = dict(zip(keys, picks(host)))
        # A tensor with no elements has no mean or var (they would be NaN, and empty is not
        # non-finite): a 0-element parameter reports max, norm and nonfinite (all 0) only; a gradient
        # row with no elements (a 0-element gradient, or one no rank had) reports nothing.
        if rows_at and 0.0 in self._picked("counts", rows_at, [_COUNT])[1](host):
            for kind, name, offset in rows_at:
                if host[offset + _COUNT] == 0:
                    for key in self._metric_keys(kind, name):
                        if kind == "grads" or key.endswith(_UNDEFINED_WHEN_EMPTY):
                            del metrics[key]
        offset = out.start("modules")
        instances = out.of(host, "modules")[_INSTANCES::_MODULE_WIDTH]
        kinds = [self._kinds["activations"]] * m + [self._kinds["activation_grads"]] * m
        module_rows = tuple((("activations", "activation_grads")[r // m], self._modules[r % m][0], offset + r * _MODULE_WIDTH)
                            for r, (n, on) in enumerate(zip(instances, kinds)) if n and on)
        keys, picks = self._picked("modules", module_rows, range(len(_STAT_FIELDS)))
        metrics.update(zip(keys, picks(host)))
        (global_batch,) = out.of(host, "batch")
        self._copy_to_aliases(metrics, FIELD_COLUMNS)  # modules that output the same tensor as another
        for index, source in self._aliases.items():
            for order in self._first_seen:
                order[index] = order[source]
        if self._batch_size or global_batch:
            metrics[GLOBAL_BATCH_SIZE] = global_batch
        if self.per_sample is not None:
            (ps_sum, ps_count), (ps_max, ps_neg_min) = out.of(host, "per_sample_sums"), out.of(host, "per_sample_maxes")
            if ps_count > 0:
                metrics[per_sample_norm_name("mean")] = ps_sum / ps_count
                metrics[per_sample_norm_name("max")] = ps_max
                metrics[per_sample_norm_name("min")] = -ps_neg_min
        info = self._localise_nonfinite(metrics, step)
        if numerics is not None:
            self._add_numerics(metrics, info, numerics, out, host, step)
            self._copy_to_aliases(metrics, NUMERICS_FIELDS)  # numerics of a shared output, as its statistics
        return metrics, info

    def _copy_to_aliases(self, metrics: dict[str, float], fields) -> None:
        """Gives each module that output the same tensor as another (self._aliases) that module's
        activation metrics of `fields`."""
        for index, source in self._aliases.items():
            name, source_name = self._modules[index][0], self._modules[source][0]
            for kind in ("activations", "activation_grads"):
                for field in fields:
                    key = metric_name(kind, source_name, field)
                    if key in metrics:
                        metrics[metric_name(kind, name, field)] = metrics[key]

    def _numerics_on_device(self, names, tensors, groups, out: _Segments,
                            rows: torch.Tensor | None) -> tuple[list, list[str], list[str]]:
        """Kurtosis and per-format shares of the parameters and gradients (`rows`, taken in the
        statistics' pass; else one more pass over them) and of the monitored activations and
        activation gradients (a pass in their hooks), and exponent histograms per kind and layer type,
        added to `out` for end_step's one copy. Returns what _add_numerics needs to read them: (row
        names, field names, histogram groups)."""
        if rows is None:  # sparse gradients: numerics of their dense form
            dense = [t.to_dense() if t.is_sparse else t for t in tensors]
            rows = numerics_states(dense, groups)  # FSDP1 flat shards: pieces merged over their groups
        act_names, act_rows = self._activation_numerics(out.device)  # where the collectives run (NCCL: the GPU)
        names, rows = [*names, *act_names], torch.cat([rows.to(out.device), act_rows])
        result = numerics_from_rows(rows, self.numerics)
        columns = [("kurtosis", result.kurtosis)]
        columns += [(numerics_field(f, s), result.shares[f][s]) for f in self.numerics for s in NUMERICS_SHARES]
        keys, index = self._histogram_groups(tuple(names), rows.device)
        hists = torch.zeros(len(keys), NUM_BINS, dtype=torch.float64, device=rows.device).index_add_(
            0, index, rows[:, :NUM_BINS])  # exact counts
        # Per group and format, the elements that under/overflow at each tensor's own power-of-two scale
        # (what a scaled recipe sees): share x count per tensor, summed exactly (integers in float64).
        count = rows[:, NUM_BINS]
        scaled = [torch.nan_to_num(result.shares[f][s]) * count for f in self.numerics
                  for s in ("underflow_scaled", "overflow_scaled")]
        scaled_counts = torch.zeros(len(keys), 2 * len(self.numerics), dtype=torch.float64, device=rows.device)
        if names:
            scaled_counts.index_add_(0, index, torch.stack(scaled, dim=1).round())
        out.add("numerics", torch.stack([c for _, c in columns], dim=1) if names else rows.new_empty(0))
        out.add("histograms", hists)
        out.add("scaled_counts", scaled_counts)
        return names, [field for field, _ in columns], keys

    def _histogram_groups(self, names: tuple[tuple[str, str], ...], device: torch.device) -> tuple[list[str], torch.Tensor]:
        """The histogram groups ("grads/Linear", ...) of numerics rows `names`, sorted, and the group of
        each row as an index tensor on `device`: built once per set of rows (not every step)."""
        cached = self._pickers.get("histogram_groups")
        if cached is None or cached[0] != (names, device):
            groups_of = [f"{kind}/{(self._param_types if kind in ('params', 'grads') else self._module_types).get(name, 'Parameter')}"
                         for kind, name in names]
            keys = sorted(set(groups_of))
            index = torch.tensor([keys.index(g) for g in groups_of], dtype=torch.long, device=device)
            cached = self._pickers["histogram_groups"] = ((names, device), keys, index)
        return cached[1], cached[2]

    def _add_numerics(self, metrics: dict[str, float], info: dict[str, Any], numerics, out: _Segments, host: list,
                      step: int) -> None:
        """The numerics metrics, histograms and alerts from end_step's host copy."""
        names, fields, keys = numerics
        table, counts, scaled = out.of(host, "numerics"), out.of(host, "histograms"), out.of(host, "scaled_counts")
        # Groups that hold no element this step (containers whose output is a child's, read once) are left out.
        held = [(i, k) for i, k in enumerate(keys) if any(counts[i * NUM_BINS:(i + 1) * NUM_BINS])]
        info["numerics_histograms"] = {k: sparse_histogram(counts[i * NUM_BINS:(i + 1) * NUM_BINS]) for i, k in held}
        width = 2 * len(self.numerics)
        info["numerics_scaled"] = {k: {f: {"underflow": int(scaled[i * width + 2 * j]), "overflow": int(scaled[i * width + 2 * j + 1])}
                                       for j, f in enumerate(self.numerics)} for i, k in held}
        alerts = []
        for i, (kind, name) in enumerate(names):
            row = table[i * len(fields):(i + 1) * len(fields)]
            # Modules that ran on no rank this step have empty activation rows: no metrics (as their statistics).
            if kind.startswith("activation") and all(math.isnan(v) for v in row):
                continue
            for field, value in zip(fields, row):
                if not math.isnan(value):
                    metrics[metric_name(kind, name, field)] = value
                    if (self.numerics_alert is not None and field.endswith(("_underflow", "_overflow"))
                            and value > self.numerics_alert):
                        alerts.append(f"{kind}/{name}: {field} {value:.3g}")
        if alerts:
            info["numerics_alerts"] = alerts
            warnings.warn(f"GAPMonitor step {step}: {len(alerts)} share(s) above numerics_alert={self.numerics_alert}: "
                          f"{alerts[:8]}{' ...' if len(alerts) > 8 else ''}", RuntimeWarning, stacklevel=4)

    def _activation_numerics(self, device: torch.device) -> tuple[list[tuple[str, str]], torch.Tensor]:
        """(kind, module) names and numerics rows of the monitored activations and activation gradients,
        each merged over its micro-batches and over the ranks of the process group (all-gathered and
        merged in rank order: exact, as the shards of a tensor). Rows of modules that did not run are
        empty (count 0)."""
        kinds = [k for k, on in enumerate((self._kinds["activations"], self._kinds["activation_grads"])) if on]
        m = len(self._modules)
        if not kinds or not m:
            return [], torch.empty(0, len(NUMERICS_COLUMNS), dtype=torch.float64, device=device)
        table = (self._num_acc.to(device) if self._num_acc is not None
                 else torch.zeros(2 * m, len(NUMERICS_COLUMNS), dtype=torch.float64, device=device))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self._group) > 1:
            parts = [torch.empty_like(table) for _ in range(dist.get_world_size(self._group))]
            dist.all_gather(parts, table, group=self._group)
            table = merge_numerics_states(torch.stack(parts))
        picked = [kind * m + i for kind in kinds for i in range(m)]
        kind_names = ("activations", "activation_grads")
        return [(kind_names[r // m], self._modules[r % m][0]) for r in picked], table[picked]

    def _picked(self, slot: str, rows: tuple[tuple[str, str, int], ...], columns) -> tuple[list[str], Any]:
        """Metric names of `rows` ((kind, name, offset of its values in the host list) each) and a
        function picking the values at offset + `columns` out of that list, in C. Built once per set
        of rows (`slot` names the cache): end_step then makes no Python loop over thousands of metrics."""
        cached = self._pickers.get(slot)
        if cached is None or cached[0] != rows:
            keys = [key for kind, name, _ in rows for key in self._metric_keys(kind, name)]
            cached = self._pickers[slot] = (rows, keys, _picker([at + col for *_, at in rows for col in columns]))
        return cached[1], cached[2]

    @staticmethod
    def _module_values(sums: torch.Tensor, maxes: torch.Tensor) -> torch.Tensor:
        """[2M, 6] per-module values from the (reduced) accumulator sums [2M, 5] and maxima [2M]:
        the fields of _STAT_FIELDS (averages over instances), then the instance count."""
        instances = sums[:, _SUM["instances"]]
        # A NaN element makes the instance norm NaN; a MAX all-reduce need not propagate NaN.
        values = {"max": maxes.masked_fill(sums[:, _SUM["sum_norm"]].isnan(), math.nan),
                  "mean": sums[:, _SUM["sum_mean"]] / instances, "var": sums[:, _SUM["sum_var"]] / instances,
                  "norm": sums[:, _SUM["sum_norm"]] / instances, "nonfinite": sums[:, _SUM["nonfinite"]]}
        return torch.stack([values[field] for field, _ in _STAT_FIELDS] + [instances], dim=1)

    def _metric_keys(self, kind: str, name: str) -> tuple[str, ...]:
        """The metric names of (kind, name), one per field of _STAT_FIELDS, built once (end_step
        runs every monitored step and reports thousands of metrics)."""
        keys = self._keys.get((kind, name))
        if keys is None:
            keys = self._keys[(kind, name)] = tuple(metric_name(kind, name, field) for field, _ in _STAT_FIELDS)
        return keys

    def _localise_nonfinite(self, metrics: dict[str, float], step: int) -> dict[str, Any]:
        """Names the first module (forward, then backward order) and the tensors with non-finite values."""
        self.nonfinite_report = {}
        # Fast path, every healthy step: a NaN or Inf element makes its mean or max non-finite, so
        # all-finite metrics mean nothing to localise (and no metric name needs parsing).
        # One sum in C checks them all: it is finite only if every metric is (a sum that overflows
        # takes the exact path below, which then finds nothing).
        if math.isfinite(sum(metrics.values())):
            return {}
        bad: dict[str, list[str]] = {}
        for key, value in metrics.items():
            parsed = parse_metric_name(key)
            if parsed is None:
                continue
            kind, name, field = parsed
            if (field == "nonfinite" and value > 0) or (field in ("mean", "max") and not math.isfinite(value)):
                if name not in bad.setdefault(kind, []):
                    bad[kind].append(name)
        if not bad:
            return {}
        report: dict[str, Any] = {}
        module_index = {name: i for i, (name, _) in enumerate(self._modules)}
        for kind, order_index in (("activations", 0), ("activation_grads", 1)):
            if kind in bad:
                seen = self._first_seen[order_index]
                ordered = sorted(bad[kind], key=lambda n: seen[module_index[n]] if seen[module_index[n]] >= 0 else 1 << 30)
                report[f"first_{kind[:-1]}"] = ordered[0]
                report[kind] = ordered
        for kind in ("params", "grads"):
            if kind in bad:
                report[kind] = bad[kind]
        self.nonfinite_report = report
        if rank_and_world()[0] == 0:
            first = report.get("first_activation") or report.get("first_activation_grad")
            where = f"first in module '{first}'" if first else f"in {', '.join(report.get('grads', report.get('params', [])))}"
            logger.warning("gapmon: non-finite values at step %s: %s", step, where)
        return {"nonfinite": report}

    # ---------------------------------------------------------------- lifetime
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("GAPMonitor: the monitor is closed")

    def close(self) -> None:
        """Removes every hook and closes the sinks (idempotent)."""
        if self.closed:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.per_sample is not None:
            self.per_sample.close()
        for sink in self.sinks:
            sink.close()
        self._set_acc(None)
        self._active = False
        self.closed = True

    def __enter__(self) -> "GAPMonitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
