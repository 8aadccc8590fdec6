"""Exact statistics of DTensors (FSDP2 `Shard(0)`, HSDP `(Replicate(), Shard(0))`, TP, ...).

Every rank computes the mergeable partial state of its local shard, then the states are
all-gathered over the mesh dimensions that *shard* the tensor and merged in mesh order
(Chan's rule). Replicated mesh dims hold identical copies, so they are not gathered and not
double counted. A rank with an empty local shard contributes an empty state. Tensors that
share a mesh and sharded mesh dims travel in one collective per mesh dim.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..utils import is_dtensor, is_dtensor_type
from . import _backend
from .layout import BLOCK_COLUMNS, Stats, check_tensor_list


def materialize_partial(x):
    """Partial (pending-reduction) placements are reduced first: their local values are not the data."""
    if any(p.is_partial() for p in x.placements):
        from torch.distributed.tensor import Replicate

        x = x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])
    return x


def _shard_mesh_dims(x) -> tuple[int, ...]:
    return tuple(d for d, p in enumerate(x.placements) if p.is_shard())


def gather_states(states: torch.Tensor, mesh, mesh_dims: Sequence[int], merge=None) -> torch.Tensor:
    """Merges [N, C] local partial states over the given mesh dims; same result on every rank."""
    for dim in mesh_dims:
        states = gather_states_over_group(states, mesh.get_group(dim), merge)
    return states


def gather_states_over_group(states: torch.Tensor, group, merge=None) -> torch.Tensor:
    """Merges [N, C] partial states over all ranks of a process group, in rank order, with `merge`
    ([R, N, C] -> [N, C]; default: the statistics states' merge_states)."""
    world = dist.get_world_size(group)
    if world == 1:
        return states
    parts = [torch.empty_like(states) for _ in range(world)]
    dist.all_gather(parts, states.contiguous(), group=group)
    return (merge or _backend.merge_states)(torch.stack(parts))


def fsdp1_shard_groups(model: torch.nn.Module) -> dict[int, Any]:
    """{id(parameter): process group} for parameters that FSDP1 (use_orig_params=True) shards.

    Such a parameter (and its gradient) is a flat view of this rank's piece of the tensor, so its
    full statistics are the merge of every rank's piece over the FSDP instance's process group.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
    except ImportError:
        return {}
    out: dict[int, Any] = {}

    def visit(module: torch.nn.Module, owner) -> None:
        if isinstance(module, FSDP):
            owner = module if module.sharding_strategy != ShardingStrategy.NO_SHARD else None
        for p in module.parameters(recurse=False):
            if owner is not None and type(p).__name__ != "FlatParameter":
                out[id(p)] = owner.process_group
        for child in module.children():
            visit(child, owner)

    visit(model, None)
    return out


def full_tensor_rows(xs: list[torch.Tensor], op: str, local_rows, merge=None,
                     flat_groups: Sequence[Any] | None = None) -> torch.Tensor:
    """Mergeable rows of the full tensors behind `xs`, the list checked once: `local_rows(xs)` when every
    tensor is whole on this rank, else each sharded one's rows merged over its mesh (`merge`) or, for FSDP1
    flat pieces, over `flat_groups[i]`. The one DTensor dispatch of the statistics and numerics ops."""
    if is_sharded(xs, op, flat_groups):
        return dtensor_multi_states(xs, flat_groups, local_states=local_rows, merge=merge)
    return local_rows(xs)


def is_sharded(xs: list[torch.Tensor], op: str, flat_groups: Sequence[Any] | None = None) -> bool:
    """Whether some tensor of `xs` is a DTensor or an FSDP1 flat piece (`flat_groups`): its rows need a
    merge over ranks. Checks the list for `op` (dtypes, layouts, one device) in the same pass."""
    kinds = check_tensor_list(xs, op)
    return any(is_dtensor_type(kind) for kind in kinds) or any(g is not None for g in flat_groups or ())


def dtensor_multi_states(xs: Sequence[torch.Tensor], flat_groups: Sequence[Any] | None = None,
                         local_states=None, merge=None) -> torch.Tensor:
    """[N, C] partial states of the full tensors behind a mix of DTensors and plain tensors.

    `flat_groups[i]`, when given and not None, is the process group over which plain tensor i is
    split into pieces (FSDP1 flat shards); its pieces are merged over that group. `local_states`
    and `merge` give another kind of mergeable row (gapmon.numerics); default: the statistics states.
    """
    xs = [materialize_partial(x) if is_dtensor(x) else x for x in xs]
    local = [x.to_local() if is_dtensor(x) else x for x in xs]
    states = (local_states or _backend.multi_states)(local)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, x in enumerate(xs):
        if is_dtensor(x) and _shard_mesh_dims(x):
            groups[("mesh", x.device_mesh, _shard_mesh_dims(x))].append(i)
        elif flat_groups is not None and flat_groups[i] is not None:
            groups[("group", flat_groups[i])].append(i)
    for key, idx in groups.items():
        index = torch.tensor(idx, device=states.device)
        rows = states.index_select(0, index)
        merged = (gather_states(rows, key[1], key[2], merge) if key[0] == "mesh"
                  else gather_states_over_group(rows, key[1], merge))
        states = states.index_copy(0, index, merged)
    return states


def dtensor_update_rows(before: list, after: list, grads: list) -> torch.Tensor:
    """update_sums rows of the full tensors behind DTensor parameters (and plain ones): the local shards'
    rows (all columns are sums) all-reduced over the mesh dims each parameter is sharded on."""
    local_b, local_a, local_g, keys = [], [], [], []
    for i, (b, a, g) in enumerate(zip(before, after, grads)):
        if not (is_dtensor(b) and is_dtensor(a)):
            if is_dtensor(b) or is_dtensor(a) or is_dtensor(g):
                raise TypeError(f"gapmon.update_sums: parameter {i}: mixes DTensors and plain tensors")
            local_b.append(b), local_a.append(a), local_g.append(g), keys.append(None)
            continue
        b, a = materialize_partial(b), materialize_partial(a)
        if a.device_mesh != b.device_mesh or tuple(a.placements) != tuple(b.placements):
            a = a.redistribute(b.device_mesh, b.placements)
        if not is_dtensor(g):
            raise TypeError(f"gapmon.update_sums: parameter {i}: a DTensor parameter with a plain gradient")
        g = materialize_partial(g)
        if g.device_mesh != b.device_mesh or tuple(g.placements) != tuple(b.placements):
            g = g.redistribute(b.device_mesh, b.placements)
        local_b.append(b.to_local()), local_a.append(a.to_local()), local_g.append(g.to_local())
        keys.append((b.device_mesh, _shard_mesh_dims(b)))
    rows = _backend.update_sums(local_b, local_a, local_g)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        if key is not None and key[1]:
            groups[key].append(i)
    for (mesh, dims), idx in groups.items():
        index = torch.tensor(idx, device=rows.device)
        part = rows.index_select(0, index)
        for dim in dims:
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        rows = rows.index_copy(0, index, part)
    return rows


def merge_block_rows(rows: torch.Tensor) -> torch.Tensor:
    """Merges [R, ..., C] block-format rows (layout.BLOCK_COLUMNS) of R pieces of the same tensors into
    [..., C]: sums, the minimum of min_nonzero, the maximum of max_block_ratio."""
    out = rows.sum(0)
    out[..., BLOCK_COLUMNS.index("min_nonzero")] = rows[..., BLOCK_COLUMNS.index("min_nonzero")].amin(0)
    out[..., BLOCK_COLUMNS.index("max_block_ratio")] = rows[..., BLOCK_COLUMNS.index("max_block_ratio")].amax(0)
    return out


def blocks_whole(x, block: int) -> bool:
    """Whether every shard of DTensor x holds whole blocks of `block` elements along the last dim: the last
    dim is not sharded, or one mesh dim shards it into chunks (torch's: ceil(n / k)) of whole blocks; a 1-D
    tensor's last dim is its dim 0."""
    last = x.dim() - 1 if x.dim() else 0
    cuts = [m for m, p in enumerate(x.placements) if p.is_shard() and p.dim % max(x.dim(), 1) == last]
    if not cuts:
        return True
    if len(cuts) > 1:
        return False
    k = x.device_mesh.size(cuts[0])
    return k == 1 or (-(-x.shape[last] // k)) % block == 0


def dtensor_block_rows(xs: list, codes: list[int], amaxes: torch.Tensor, block: int) -> torch.Tensor:
    """block_numerics rows of the full tensors behind DTensors (and plain tensors): shards that keep the
    blocks whole give local rows merged over the mesh dims that shard them; a tensor whose shards cut a
    block is cast whole (all-gathered), exactly."""
    xs = [materialize_partial(x) if is_dtensor(x) else x for x in xs]
    whole = [not is_dtensor(x) or blocks_whole(x, block) for x in xs]
    local = [(x.to_local() if is_dtensor(x) else x) if ok else x.full_tensor() for x, ok in zip(xs, whole)]
    rows = _backend.block_numerics_rows(local, codes, amaxes)
    n, f, c = rows.shape
    flat = rows.reshape(n, f * c)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, (x, ok) in enumerate(zip(xs, whole)):
        if ok and is_dtensor(x) and _shard_mesh_dims(x):
            groups[(x.device_mesh, _shard_mesh_dims(x))].append(i)
    merge = lambda parts: merge_block_rows(parts.reshape(parts.shape[0], parts.shape[1], f, c)).reshape(  # noqa: E731
        parts.shape[1], f * c)
    for (mesh, dims), idx in groups.items():
        index = torch.tensor(idx, device=flat.device)
        flat = flat.index_copy(0, index, gather_states(flat.index_select(0, index), mesh, dims, merge))
    return flat.reshape(n, f, c)


def dtensor_instance_stats(x, correction: int = 1) -> Stats:
    """Per-instance statistics of a DTensor whose non-batch dims are not sharded.

    The result fields are DTensors laid out like dim 0 of `x` (sharded where the batch is).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    x = materialize_partial(x)
    if any(p.is_shard() and p.dim != 0 for p in x.placements):
        raise NotImplementedError(
            "gapmon.instance_stats: DTensors sharded along a non-batch dim are not supported; "
            "redistribute to Shard(0)/Replicate() first or pass x.full_tensor()"
        )
    local = Stats.from_rows(_backend.instance_rows(x.to_local(), correction))
    placements = [Shard(0) if p.is_shard() else Replicate() for p in x.placements]
    return Stats(*(DTensor.from_local(f, x.device_mesh, placements, run_check=False) for f in local))
