"""The gradient noise scale from FSDP2's (and HSDP's) own reduction, without per-sample norms: FSDP2 hands
each parameter group's reduce-scatter the flat concatenation of this rank's unsharded gradients (its local
batch's mean gradient, zero-padded), so wrapping that reduce-scatter reads the local squared norm from a buffer
FSDP2 holds anyway; the reduced gradient is the sharded one FSDP2 leaves on the parameters, scaled from its
divide factor back to the mean over the data-parallel ranks. Exact for any divide factor (per group), reduce
dtype and accumulation under set_requires_gradient_sync(False).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .._torch_compat import FSDPReduction, fsdp_param_groups
from ..stats import ops
from ..stats.layout import STAT_NAMES
from ..utils import rank_and_world
from .data_parallel import ReductionNoise
from .noise_scale import NoiseScale

_NORM = STAT_NAMES.index("norm")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _MeasuredReduceScatter:
    """A parameter group's reduce-scatter (FSDP2's Comm interface: allocate and __call__) that measures the
    group's local gradient before calling the one it replaces."""

    def __init__(self, inner: Any, reduction: FSDPReduction, state: "FullyShardedNoise"):
        self.inner, self.reduction, self.state = inner, reduction, state

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if self.state.active:
            self.state.measure(self.reduction, input_tensor)
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                          async_op=async_op)


class FullyShardedNoise(ReductionNoise):
    """Wraps the reduce-scatter of every FSDP2 parameter group in `model` (after the user's own settings:
    FSDP2's setters refuse a custom reduce-scatter they did not make)."""

    def __init__(self, model: nn.Module, noise: NoiseScale, monitor_group: Any = None):
        groups = fsdp_param_groups(model)
        if not groups:
            raise TypeError(f"GAPMonitor.watch_data_parallel: expected a DistributedDataParallel or a model with "
                            f"FSDP2 (fully_shard) modules, got {type(model).__name__} without either")
        super().__init__(noise, monitor_group)
        world = rank_and_world(monitor_group)[1]
        self.reductions = [FSDPReduction(group) for group in groups]
        sizes = {r.data_parallel_size for r in self.reductions}
        if sizes != {world}:
            raise ValueError(f"GAPMonitor.watch_data_parallel: FSDP2 reduces over {sorted(sizes)} data-parallel "
                             f"ranks, the monitor's process group has {world}: give the monitor the data-parallel "
                             f"group (ranks that share samples, as tensor-parallel ones do, are not separate batches)")
        if any(r.shard_size == 1 and r.data_parallel_size > 1 for r in self.reductions):
            raise ValueError("GAPMonitor.watch_data_parallel: FSDP2 with one shard per replica only all-reduces "
                             "(it calls no reduce-scatter to read the local gradient from): use DDP, or "
                             "per_sample_grad_norms=True for the noise scale")
        if any(isinstance(r.comm, _MeasuredReduceScatter) for r in self.reductions):
            raise ValueError("GAPMonitor.watch_data_parallel: this FSDP2 model is watched already")
        self._calls: dict[int, int] = {}
        for reduction in self.reductions:
            reduction.set_comm(_MeasuredReduceScatter(reduction.comm, reduction, self))

    def begin(self, active: bool) -> None:
        super().begin(active)
        self._calls = {}

    def measure(self, reduction: FSDPReduction, flat_input: torch.Tensor) -> None:
        """Called with a group's reduce-scatter input (this rank's gradients / FSDP2's predivide factor)."""
        key = id(reduction)
        self._calls[key] = self._calls.get(key, 0) + 1
        if self._calls[key] > 1:  # reduced twice in one step (accumulation with gradient sync on)
            self.flag_mixed()
        left = [_local(p.grad) for p in reduction.params if p.grad is not None]
        if left:  # FSDP2 adds the reduced gradient to these: the step's would not be one reduction
            self.flag_mixed(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in left]).sum())
        pre = reduction.predivide_factor(flat_input.dtype, flat_input.device.type)
        self.add_local(torch.linalg.vector_norm(flat_input, dtype=torch.float64).square() * (pre * pre))

    def reduced_on_device(self, device: torch.device) -> torch.Tensor | None:
        """|mean over the ranks of their local gradients|^2 of the groups reduced this step: FSDP2's sharded
        gradient is their sum / divide factor, so the mean is it x factor / ranks (full norms of DTensors)."""
        grads, scales = [], []
        for reduction in self.reductions:
            if id(reduction) in self._calls:
                for p in reduction.params:
                    if p.grad is not None:
                        grads.append(p.grad)
                        scales.append(reduction.divide_factor / reduction.data_parallel_size)
        if not grads:
            return None
        norms = ops.multi_tensor_rows(grads, 0)[:, _NORM].to(device, torch.float64)
        return (norms * torch.tensor(scales, dtype=torch.float64, device=device)).square().sum()
