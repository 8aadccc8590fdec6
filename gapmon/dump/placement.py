"""How a gradient is laid out across ranks: the run's parallel layout (config.json) and each shard's
record (global shape, placements, offsets), both read back by reconstruction."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .. import _torch_compat
from ..stats.distributed import materialize_partial
from ..utils import is_dtensor, rank_and_world
from .format import REPLICATE, ShardRecord, dtype_name, placement_name


def parallel_layout(model: nn.Module) -> dict[str, Any]:
    """parallel_type (single|ddp|fsdp|hsdp), world_size, shard_degree, num_replicas, mesh_shape."""
    _, world = rank_and_world()
    for p in model.parameters():
        if is_dtensor(p):
            mesh = p.device_mesh
            shard_dims = [d for d, pl in enumerate(p.placements) if pl.is_shard()]
            repl_dims = [d for d, pl in enumerate(p.placements) if pl.is_replicate()]
            shard = 1
            for d in shard_dims:
                shard *= mesh.size(d)
            replicas = 1
            for d in repl_dims:
                replicas *= mesh.size(d)
            kind = "hsdp" if repl_dims and shard_dims else ("fsdp" if shard_dims else "ddp")
            return {"parallel_type": kind, "world_size": world, "shard_degree": shard, "num_replicas": replicas,
                    "mesh_shape": list(mesh.shape), "mesh_dim_names": list(mesh.mesh_dim_names or [])}
    if world > 1:
        return {"parallel_type": "ddp", "world_size": world, "shard_degree": 1, "num_replicas": world,
                "mesh_shape": [world], "mesh_dim_names": []}
    return {"parallel_type": "single", "world_size": 1, "shard_degree": 1, "num_replicas": 1, "mesh_shape": [1],
            "mesh_dim_names": []}


def shard_record(g: torch.Tensor, rank: int) -> tuple[torch.Tensor, ShardRecord]:
    """The local piece of gradient g and its record (global shape, placements, offsets; no checksum yet)."""
    if is_dtensor(g):
        g = materialize_partial(g)
        mesh = g.device_mesh
        local = g.to_local()
        local_shape, offsets = _torch_compat.local_shape_and_global_offset(g.shape, mesh, g.placements)
        return local, ShardRecord(
            global_shape=list(g.shape), local_shape=list(local_shape), offsets=list(offsets),
            placements=[placement_name(p) for p in g.placements], mesh_shape=list(mesh.shape),
            coordinate=list(mesh.get_coordinate() or []), dtype=dtype_name(g.dtype))
    _, world = rank_and_world()
    return g, ShardRecord(global_shape=list(g.shape), local_shape=list(g.shape), offsets=[0] * g.dim(),
                          placements=[REPLICATE], mesh_shape=[world], coordinate=[rank], dtype=dtype_name(g.dtype))


def with_layout_of(g: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a host copy of g's local shard) as a tensor laid out like gradient `g`."""
    if not is_dtensor(g):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride())
