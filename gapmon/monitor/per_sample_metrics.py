"""What GAPMonitor reports of per-sample gradient norms: their mean, max and min over the global batch, and
the gradient noise scale of the covered parameters (monitor.noise_scale), from sums reduced over the ranks
with the monitor's other sums and read in its one host copy."""
from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .. import _torch_compat
from ..per_sample.sample_ids import sample_ids as checked_sample_ids
from ..stats.layout import STAT_NAMES
from .metric_names import GNS_ALL, metric_name, per_sample_norm_name
from .noise_scale import NoiseScale
from .step_buffer import StepBuffer
from .tensor_rows import WatchedTensors


class PerSampleMetrics:
    """The per-sample metrics of `per_sample` (a PerSampleGradNorms). `grads_measured`: the monitor's own
    gradient metrics hold each covered gradient's norm (else they are measured here, for the noise scale)."""

    def __init__(self, per_sample: Any, gns_ema: float, grads_measured: bool, process_group: Any):
        self.per_sample = per_sample
        self.noise = NoiseScale(gns_ema)
        self.grads_measured, self.group = grads_measured, process_group
        self._groups: list[str] = []
        self._types: dict[str, str] = {}
        self._measured: list[str] = []
        self._warned_factors = False
        self._ids: list[torch.Tensor] | None = None  # this step's sample ids (begin_step / add_samples)

    def set_sample_ids(self, ids: Any) -> None:
        """The ids of this rank's samples of the step (None: each rank's samples are its own)."""
        self._ids = None if ids is None else [checked_sample_ids(ids, "GAPMonitor.begin_step")]

    def add_sample_ids(self, ids: Any, n: int) -> None:
        """The ids of `n` more samples of this step (a micro-batch)."""
        ids = checked_sample_ids(ids, "GAPMonitor.add_samples")
        if ids.numel() != n:
            raise ValueError(f"GAPMonitor.add_samples: got {ids.numel()} sample ids for {n} samples")
        self._ids = (self._ids or []) + [ids]

    def on_device(self, sums: StepBuffer, maxes: StepBuffer) -> None:
        """Adds this rank's sums and maxima (reduced over the ranks by the monitor)."""
        dev = sums.device
        norms = self.per_sample.local_norms().to(dev, torch.float64)
        sums.add("per_sample", torch.stack((norms.sum(), torch.tensor(float(norms.numel()), dtype=torch.float64, device=dev))))
        maxes.add("per_sample", torch.cat((norms.max().reshape(1), (-norms).max().reshape(1))) if norms.numel()
                  else torch.full((2,), -math.inf, dtype=torch.float64, device=dev))
        self._types = self.per_sample.covered_layer_types()
        by_type = self.per_sample.local_norms_by_layer_type()
        squared = {GNS_ALL: norms * norms}
        squared.update({t: by_type[t].to(dev, torch.float64) ** 2 if t in by_type else torch.zeros_like(norms)
                        for t in set(self._types.values())})
        self._groups = sorted(squared)
        # What the data-parallel reduction divides the sum of the ranks' gradients by: each sample's weight in it.
        weights, divided_by = self.per_sample.loss_weights(), self._divided_by()
        if self._ids is None:
            self.noise.on_device(sums, squared, weights, divided_by)
            return
        ids, self._ids, refusal = torch.cat(self._ids), None, ""
        try:
            ids = checked_sample_ids(ids, "GAPMonitor.add_samples")  # an id repeated over micro-batches
        except ValueError as error:  # raised on every rank by the gather below, none left waiting in it
            refusal = str(error)
        self.noise.on_device_by_id(sums, squared, weights, divided_by, ids, self.group, refusal)  # and the count

    def _divided_by(self) -> float:
        """The divisor of the data-parallel reduction: the ranks of the monitor's group (DDP, FSDP2 by default),
        or the factor FSDP2's set_gradient_divide_factor set (the same on every FSDP unit, else NaN: the noise
        scale is then left out rather than wrong)."""
        if not (dist.is_available() and dist.is_initialized()):  # one process: no data-parallel reduction, no FSDP2
            return 1.0
        world = dist.get_world_size(self.group)
        factors = _torch_compat.fsdp_gradient_divide_factors(self.per_sample.model)
        if not factors or factors == {None}:
            return float(world)
        if len(factors) == 1:
            return float(next(iter(factors)))
        if not self._warned_factors:
            self._warned_factors = True
            warnings.warn(f"GAPMonitor: the FSDP units divide their gradients by different factors ({factors}); the "
                          "gradient noise scale is left out", RuntimeWarning, stacklevel=5)
        return math.nan

    def to_copy(self, out: StepBuffer, sums: StepBuffer, sums_t: torch.Tensor, maxes: StepBuffer,
                maxes_t: torch.Tensor) -> None:
        """Adds the reduced values, and the covered gradients' norms when the monitor does not measure
        them, to the monitor's host copy."""
        out.add("per_sample_sums", sums.of(sums_t, "per_sample"))
        out.add("per_sample_maxes", maxes.of(maxes_t, "per_sample"))
        out.add("gns", sums.of(sums_t, "gns"))
        if not self.grads_measured:
            grads = dict(self.per_sample.covered_gradients(self._types))
            present = [n for n in self._types if grads.get(n) is not None]
            self._measured = present
            rows = WatchedTensors.rows([grads[n] for n in present], [None] * len(present), 0, False, out.device)[0]
            out.add("gns_grad_norms", rows[:, STAT_NAMES.index("norm")] if rows.numel() else rows.new_empty(0))

    def metrics(self, out: StepBuffer, host: list, tensor_metrics: dict[str, float]) -> dict[str, float]:
        """The step's per-sample metrics from the host copy (`tensor_metrics`: the monitor's gradient metrics)."""
        metrics: dict[str, float] = {}
        (ps_sum, ps_count), (ps_max, ps_neg_min) = out.of(host, "per_sample_sums"), out.of(host, "per_sample_maxes")
        if ps_count > 0:
            metrics[per_sample_norm_name("mean")] = ps_sum / ps_count
            metrics[per_sample_norm_name("max")] = ps_max
            metrics[per_sample_norm_name("min")] = -ps_neg_min
        if self.grads_measured:
            norms = {n: tensor_metrics.get(metric_name("grads", n, "norm"), 0.0) for n in self._types}
        else:
            norms = dict(zip(self._measured, out.of(host, "gns_grad_norms")))
        batch_grad_sq = {GNS_ALL: sum(v * v for v in norms.values())}
        for name, value in norms.items():
            batch_grad_sq[self._types[name]] = batch_grad_sq.get(self._types[name], 0.0) + value * value
        metrics.update(self.noise.metrics(self._groups, out.of(host, "gns"), batch_grad_sq))
        return metrics
