"""The gradient noise scale without per-sample norms, from DDP's own reduction: a communication hook reads
each bucket of this rank's gradient before DDP's all-reduce (the local batch's mean gradient) and after it
(the global batch's), so the two-batch estimator of McCandlish et al. (B_small = the local batch, B_big =
the global batch) costs two norms of buffers DDP already holds, and every rank's local gradient norm is
known: the rank whose local gradient stands out is named.

Metrics: ``gap/gns/data_parallel/{grad_norm_sq, noise_trace, b_simple_step, b_simple}``, and
``gap/local_grad_norm/{mean, max, min, max_rank}`` (each rank's local gradient norm, all parameters).
"""
from __future__ import annotations

import math
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


class DataParallelNoise:
    """Registers a communication hook on `ddp` (a DistributedDataParallel: it takes one hook, so not together
    with another) that does DDP's own averaging all-reduce and sums, while `active`, the squared norms of the
    buckets before and after it."""

    def __init__(self, ddp: Any, noise: NoiseScale, monitor_group: Any = None):
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"GAPMonitor.watch_data_parallel: expected a DistributedDataParallel, got {type(ddp).__name__}")
        self.group, self.monitor_group = ddp.process_group, monitor_group
        self.noise = noise
        self.active = False
        self.local_sq: torch.Tensor | None = None
        self.reduced_sq: torch.Tensor | None = None
        ddp.register_comm_hook(self, DataParallelNoise._hook)

    @staticmethod
    def _hook(state, bucket):  # no annotations: DDP compares them with its types (and these would be strings)
        """DDP's default averaging all-reduce of one bucket, with its squared norm before and after."""
        buffer = bucket.buffer()
        if state.active:
            local = torch.linalg.vector_norm(buffer, dtype=torch.float64).square()
            state.local_sq = local if state.local_sq is None else state.local_sq + local
        future = default_hooks.allreduce_hook(state.group, bucket)  # DDP's own: the mean over the ranks

        def reduced(fut):
            tensor = fut.value()
            if state.active:
                sq = torch.linalg.vector_norm(tensor, dtype=torch.float64).square()
                state.reduced_sq = sq if state.reduced_sq is None else state.reduced_sq + sq
            return tensor

        return future.then(reduced)

    def begin(self, active: bool) -> None:
        self.active = active
        self.local_sq = self.reduced_sq = None

    def on_device(self, sums: StepBuffer, maxes: StepBuffer) -> None:
        """This rank's local squared norm in its own slot of a [world] vector (the monitor's SUM all-reduce
        gathers them), and the reduced gradient's squared norm (the same on every rank: its mean is taken)."""
        rank, world = rank_and_world(self.monitor_group)
        device = sums.device
        slots = torch.zeros(world + 1, dtype=torch.float64, device=device)
        if self.local_sq is not None:
            slots[rank] = self.local_sq.to(device)
        if self.reduced_sq is not None:
            slots[world] = self.reduced_sq.to(device) / world
        sums.add("data_parallel", slots)

    def to_copy(self, out: StepBuffer, sums: StepBuffer, sums_t: torch.Tensor, maxes: StepBuffer,
                maxes_t: torch.Tensor) -> None:
        out.add("data_parallel", sums.of(sums_t, "data_parallel"))

    def metrics(self, values: list[float], local_batch_mean: float, global_batch: float) -> dict[str, float]:
        """The step's metrics from the reduced slots and the batch sizes (samples per rank, in total)."""
        *local_sq, reduced_sq = values
        if not any(local_sq):  # no backward synchronised this step (no_sync throughout)
            return {}
        norms = [math.sqrt(v) for v in local_sq]
        metrics = {local_norm_name("mean"): sum(norms) / len(norms), local_norm_name("max"): max(norms),
                   local_norm_name("min"): min(norms), local_norm_name("max_rank"): float(norms.index(max(norms)))}
        small = sum(local_sq) / len(local_sq)  # every rank's local mean gradient: their average is less noisy
        metrics.update(self.noise.add(GROUP, two_batch_estimates(small, reduced_sq, local_batch_mean, global_batch)))
        return metrics
