"""From end_step's host copy to metric names and values: the parameter and gradient rows, the modules' rows
(activations and their gradients, averaged over instances), and the modules that returned another module's
output (read once, reported under both names)."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..stats.layout import ACC_NAMES, STAT_NAMES
from .activations import ACTIVATION_KINDS, ActivationRecorder
from .metric_names import FIELD_COLUMNS, metric_name
from .step_buffer import MetricPickers, StepBuffer

_ROW = len(STAT_NAMES)  # columns of a statistics row
# Activation accumulator columns (csrc/core/stats_state.h via gapmon.stats): every column is summed
# over ranks except max |x|, which is a max.
ACC_MAX = ACC_NAMES.index("max_abs")
ACC_SUMS = tuple(i for i in range(len(ACC_NAMES)) if i != ACC_MAX)
# (metric name, column of a statistics row)
_STAT_FIELDS = tuple((field, STAT_NAMES.index(column)) for field, column in FIELD_COLUMNS.items())
_COUNT = STAT_NAMES.index("count")
_SUM = {ACC_NAMES[i]: k for k, i in enumerate(ACC_SUMS)}  # column of each sum in the reduced sums
_MODULE_WIDTH = len(_STAT_FIELDS) + 1  # a per-module row: the fields, then the instance count
_INSTANCES = len(_STAT_FIELDS)
_UNDEFINED_WHEN_EMPTY = ("/mean", "/var")  # metrics a tensor with no elements does not have


def module_values(sums: torch.Tensor, maxes: torch.Tensor) -> torch.Tensor:
    """[2M, 6] per-module values from the (reduced) accumulator sums [2M, 5] and maxima [2M]:
    the fields of _STAT_FIELDS (averages over instances), then the instance count."""
    instances = sums[:, _SUM["instances"]]
    # A NaN element makes the instance norm NaN; a MAX all-reduce need not propagate NaN.
    values = {"max": maxes.masked_fill(sums[:, _SUM["sum_norm"]].isnan(), math.nan),
              "mean": sums[:, _SUM["sum_mean"]] / instances, "var": sums[:, _SUM["sum_var"]] / instances,
              "norm": sums[:, _SUM["sum_norm"]] / instances, "nonfinite": sums[:, _SUM["nonfinite"]]}
    return torch.stack([values[field] for field, _ in _STAT_FIELDS] + [instances], dim=1)


def reduced_step(acc: torch.Tensor, batch_size: int, group: Any, contributors: list) -> StepBuffer:
    """The activation sums and maxima, this rank's batch size and what each contributor adds (its
    on_device(sums, maxes)), reduced over the ranks of `group` with one SUM and one MAX all-reduce, then
    gathered (each contributor's to_copy) in one buffer for the host copy."""
    dev = acc.device
    sums, maxes = StepBuffer(dev), StepBuffer(dev)
    sums.add("acc", acc[:, list(ACC_SUMS)])
    maxes.add("acc", acc[:, ACC_MAX])
    sums.add("batch", torch.tensor([float(batch_size)], dtype=torch.float64, device=dev))
    for part in contributors:
        part.on_device(sums, maxes)
    sums_t, maxes_t = sums.cat(), maxes.cat()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sums_t, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(maxes_t, op=dist.ReduceOp.MAX, group=group)
    out = StepBuffer(dev)
    out.add("modules", module_values(sums.of(sums_t, "acc").view(acc.shape[0], len(ACC_SUMS)), maxes.of(maxes_t, "acc")))
    out.add("batch", sums.of(sums_t, "batch"))
    for part in contributors:
        part.to_copy(out, sums, sums_t, maxes, maxes_t)
    return out


class StepReadout:
    """The metrics of one step's host copy, with the pickers cached across steps."""

    def __init__(self, recorder: ActivationRecorder):
        self.recorder = recorder
        self.pickers = MetricPickers(tuple(field for field, _ in _STAT_FIELDS))

    def tensor_metrics(self, names: list[tuple[str, str]], out: StepBuffer, host: list) -> dict[str, float]:
        """The parameter and gradient metrics from the host copy."""
        rows_at = tuple((kind, name, out.start("rows") + i * _ROW) for i, (kind, name) in enumerate(names))
        keys, picks = self.pickers.picked("tensors", rows_at, [col for _, col in _STAT_FIELDS])
        metrics: dict[str, float] = dict(zip(keys, picks(host)))
        # A tensor with no elements has no mean or var (they would be NaN, and empty is not
        # non-finite): a 0-element parameter reports max, norm and nonfinite (all 0) only; a gradient
        # row with no elements (a 0-element gradient, or one no rank had) reports nothing.
        if rows_at and 0.0 in self.pickers.picked("counts", rows_at, [_COUNT])[1](host):
            for kind, name, offset in rows_at:
                if host[offset + _COUNT] == 0:
                    for key in self.pickers.keys(kind, name):
                        if kind == "grads" or key.endswith(_UNDEFINED_WHEN_EMPTY):
                            del metrics[key]
        return metrics

    def module_metrics(self, out: StepBuffer, host: list) -> dict[str, float]:
        """The activation and activation-gradient metrics of the modules that ran, from the host copy."""
        modules = self.recorder.modules
        m = len(modules)
        offset = out.start("modules")
        instances = out.of(host, "modules")[_INSTANCES::_MODULE_WIDTH]
        kinds = [self.recorder.kinds[0]] * m + [self.recorder.kinds[1]] * m
        module_rows = tuple((ACTIVATION_KINDS[r // m], modules[r % m][0], offset + r * _MODULE_WIDTH)
                            for r, (n, on) in enumerate(zip(instances, kinds)) if n and on)
        keys, picks = self.pickers.picked("modules", module_rows, range(len(_STAT_FIELDS)))
        return dict(zip(keys, picks(host)))

    def copy_to_aliases(self, metrics: dict[str, float], fields) -> None:
        """Gives each module that output the same tensor as another that module's activation metrics
        of `fields`."""
        modules = self.recorder.modules
        for index, source in self.recorder.aliases.items():
            name, source_name = modules[index][0], modules[source][0]
            for kind in ACTIVATION_KINDS:
                for field in fields:
                    key = metric_name(kind, source_name, field)
                    if key in metrics:
                        metrics[metric_name(kind, name, field)] = metrics[key]
