"""The gradient noise scale without per-sample norms, from the data-parallel reduction itself: each rank's
gradient before the reduction is its local batch's mean gradient, the reduced one the global batch's, so the
two-batch estimator of McCandlish et al. (B_small = the local batch, B_big = the global batch) costs two
norms of buffers the reduction holds anyway, and every rank's local gradient norm is known: the rank whose
local gradient stands out is named. `DataParallelNoise` reads DDP's buckets through its communication hook;
`fully_sharded_noise.FullyShardedNoise` reads FSDP2/HSDP's reduce-scatter input.

Metrics: ``gap/gns/data_parallel/{grad_norm_sq, noise_trace, b_simple_step, b_simple}``, and
``gap/local_grad_norm/{mean, max, min, max_rank}`` (each rank's local gradient norm, the reduced parameters).
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..utils import rank_and_world
from .metric_names import PREFIX
from .noise_scale import NoiseScale, two_batch_estimates
from .step_buffer import StepBuffer

GROUP = "data_parallel"


def local_norm_name(field: str) -> str:
    """``gap/local_grad_norm/{field}`` (field: mean, max, min or max_rank)."""
    return f"{PREFIX}/local_grad_norm/{field}"


def _add(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if total is None else total + value


class ReductionNoise:
    """What a data-parallel reduction tells about the step, while `active` (the backward passes of a
    monitored step): this rank's local squared gradient norm, the reduced one, and whether the step's
    gradient is not one reduction of this step's local gradients (reduced twice: accumulation without
    no_sync; or added to gradients left from before), which leaves the estimate out with a warning."""

    def __init__(self, noise: NoiseScale, monitor_group: Any):
        self.noise, self.monitor_group = noise, monitor_group
        self.active = False
        self.local_sq: torch.Tensor | None = None
        self.reduced_sq: torch.Tensor | None = None
        self.mixed: torch.Tensor | None = None  # > 0: the step's gradient is not one reduction of its own
        self._warned = False

    def begin(self, active: bool) -> None:
        self.active = active
        self.local_sq = self.reduced_sq = self.mixed = None

    def add_local(self, sq: torch.Tensor) -> None:
        self.local_sq = _add(self.local_sq, sq)

    def add_reduced(self, sq: torch.Tensor) -> None:
        self.reduced_sq = _add(self.reduced_sq, sq)

    def flag_mixed(self, amount: torch.Tensor | float = 1.0) -> None:
        amount = torch.as_tensor(amount, dtype=torch.float64)
        self.mixed = _add(self.mixed, amount.to(self.mixed.device if self.mixed is not None else amount.device))

    def reduced_on_device(self, device: torch.device) -> torch.Tensor | None:
        """The squared norm of the reduced (global mean) gradient, the same on every rank."""
        return self.reduced_sq

    def on_device(self, sums: StepBuffer, maxes: StepBuffer) -> None:
        """This rank's local squared norm in its own slot of a [world] vector (the monitor's SUM all-reduce
        gathers them), the reduced gradient's squared norm (the same on every rank: its mean is taken) and
        the mixed-gradient flag."""
        rank, world = rank_and_world(self.monitor_group)
        device = sums.device
        slots = torch.zeros(world + 2, dtype=torch.float64, device=device)
        if self.local_sq is not None:
            slots[rank] = self.local_sq.to(device)
        reduced = self.reduced_on_device(device)
        if reduced is not None:
            slots[world] = reduced.to(device) / world
        if self.mixed is not None:
            slots[world + 1] = self.mixed.to(device)
        sums.add(GROUP, slots)

    def to_copy(self, out: StepBuffer, sums: StepBuffer, sums_t: torch.Tensor, maxes: StepBuffer,
                maxes_t: torch.Tensor) -> None:
        out.add(GROUP, sums.of(sums_t, GROUP))

    def metrics(self, values: list[float], local_batch_mean: float, global_batch: float) -> dict[str, float]:
        """The step's metrics from the reduced slots and the batch sizes (samples per rank, in total)."""
        *local_sq, reduced_sq, mixed = values
        if not any(local_sq):  # no backward synchronised this step (no_sync throughout)
            return {}
        if mixed > 0:
            if not self._warned:
                self._warned = True
                warnings.warn("gapmon: the gradient noise scale from the data-parallel reduction is left out of "
                              "steps whose gradient is not one reduction of the step's local gradients (reduced "
                              "more than once: accumulate under no_sync / set_requires_gradient_sync(False); or "
                              "added to gradients not zeroed since the last step)", stacklevel=3)
            return {}
        norms = [math.sqrt(v) for v in local_sq]
        metrics = {local_norm_name("mean"): sum(norms) / len(norms), local_norm_name("max"): max(norms),
                   local_norm_name("min"): min(norms), local_norm_name("max_rank"): float(norms.index(max(norms)))}
        small = sum(local_sq) / len(local_sq)  # every rank's local mean gradient: their average is less noisy
        metrics.update(self.noise.add(GROUP, two_batch_estimates(small, reduced_sq, local_batch_mean, global_batch)))
        return metrics


class DataParallelNoise(ReductionNoise):
    """Registers a communication hook on `ddp` (a DistributedDataParallel: it takes one hook, so not together
    with another) that does DDP's own averaging all-reduce and sums, while `active`, the squared norms of the
    buckets before and after it."""

    def __init__(self, ddp: Any, noise: NoiseScale, monitor_group: Any = None):
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"GAPMonitor.watch_data_parallel: expected a DistributedDataParallel or an FSDP2 model, "
                            f"got {type(ddp).__name__}")
        super().__init__(noise, monitor_group)
        self.group = ddp.process_group
        self.buckets: set[int] = set()
        ddp.register_comm_hook(self, DataParallelNoise._hook)

    def begin(self, active: bool) -> None:
        super().begin(active)
        self.buckets = set()

    @staticmethod
    def _hook(state, bucket):  # no annotations: DDP compares them with its types (and these would be strings)
        """DDP's default averaging all-reduce of one bucket, with its squared norm before and after."""
        if state.active:
            if bucket.index() in state.buckets:  # a second reduction in the step
                state.flag_mixed()
            state.buckets.add(bucket.index())
            state.add_local(torch.linalg.vector_norm(bucket.buffer(), dtype=torch.float64).square())
        future = default_hooks.allreduce_hook(state.group, bucket)  # DDP's own: the mean over the ranks

        def reduced(fut):
            tensor = fut.value()
            if state.active:
                state.add_reduced(torch.linalg.vector_norm(tensor, dtype=torch.float64).square())
            return tensor

        return future.then(reduced)
