"""Exact statistics of DTensors (FSDP2 `Shard(0)`, HSDP `(Replicate(), Shard(0))`, TP, ...).

Every rank computes the mergeable partial state of its local shard, then the states are
all-gathered over the mesh dimensions that *shard* the tensor and merged in mesh order
(Chan's rule). Replicated mesh dims hold identical copies, so they are not gathered and not
double counted. A rank with an empty local shard contributes an empty state. Tensors that
share a mesh and sharded mesh dims travel in one collective per mesh dim.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch
import torch.distributed as dist

from . import ops
from .stats import Stats


def _materialize_partial(x):
    """Partial (pending-reduction) placements are reduced first: their local values are not the data."""
    if any(p.is_partial() for p in x.placements):
        from torch.distributed.tensor import Replicate

        x = x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])
    return x


def _shard_mesh_dims(x) -> tuple[int, ...]:
    return tuple(d for d, p in enumerate(x.placements) if p.is_shard())


def gather_states(states: torch.Tensor, mesh, mesh_dims: Sequence[int]) -> torch.Tensor:
    """Merges [N, 7] local partial states over the given mesh dims; same result on every rank."""
    for dim in mesh_dims:
        group = mesh.get_group(dim)
        world = dist.get_world_size(group)
        if world == 1:
            continue
        parts = [torch.empty_like(states) for _ in range(world)]
        dist.all_gather(parts, states.contiguous(), group=group)
        states = ops.merge_states(torch.stack(parts))
    return states


def dtensor_multi_states(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """[N, 7] partial states of the full tensors behind a mix of DTensors and plain tensors."""
    xs = [_materialize_partial(x) if ops._is_dtensor(x) else x for x in xs]
    local = [x.to_local() if ops._is_dtensor(x) else x for x in xs]
    states = ops.multi_tensor_states(local)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, x in enumerate(xs):
        if ops._is_dtensor(x) and _shard_mesh_dims(x):
            groups[(x.device_mesh, _shard_mesh_dims(x))].append(i)
    for (mesh, dims), idx in groups.items():
        index = torch.tensor(idx, device=states.device)
        states = states.index_copy(0, index, gather_states(states.index_select(0, index), mesh, dims))
    return states


def dtensor_multi_stats(xs: Sequence[torch.Tensor], correction: int = 1) -> torch.Tensor:
    """[N, 7] float32 statistics rows of the full tensors."""
    return ops.finalize_states(dtensor_multi_states(xs), correction).rows()


def dtensor_instance_stats(x, correction: int = 1) -> Stats:
    """Per-instance statistics of a DTensor whose non-batch dims are not sharded.

    The result fields are DTensors laid out like dim 0 of `x` (sharded where the batch is).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    x = _materialize_partial(x)
    if any(p.is_shard() and p.dim != 0 for p in x.placements):
        raise NotImplementedError(
            "gapmon.instance_stats: DTensors sharded along a non-batch dim are not supported; "
            "redistribute to Shard(0)/Replicate() first or pass x.full_tensor()"
        )
    local = ops.instance_stats(x.to_local(), correction)
    placements = [Shard(0) if p.is_shard() else Replicate() for p in x.placements]
    return Stats(*(DTensor.from_local(f, x.device_mesh, placements, run_check=False) for f in local))
