"""Sample ids for PerSampleGradNorms.global_norms: validated as exact int64, and all-gathered with the norms
across ranks (vectors of different lengths, one collective)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..utils import first_of_each_id


def sample_ids(sample_ids: Any, op: str = "PerSampleGradNorms.global_norms") -> torch.Tensor:
    """Sample ids as an int64 vector, exact (ids of any size a 64-bit integer holds); ValueError naming
    ids that are not integers, or that repeat (each of this rank's samples has its own id)."""
    ids = torch.as_tensor(sample_ids).detach().reshape(-1).cpu()
    if ids.dtype == torch.bool or ids.is_complex():
        raise TypeError(f"{op}: sample ids must be integers, got {ids.dtype}")
    if ids.is_floating_point():
        fractional = ids[(ids != ids.trunc()) | ~torch.isfinite(ids)]
        if fractional.numel():
            raise ValueError(f"{op}: sample ids must be integers, got {fractional[:8].tolist()}")
        if ids.numel() and ids.abs().max() >= 2.0 ** 53:
            raise ValueError(f"{op}: float sample ids of 2^53 or more are not exact; pass "
                             "them as an integer tensor (torch.int64) or Python ints")
    ids = ids.to(torch.int64)
    unique, counts = torch.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{op}: sample ids repeat on this rank: {unique[counts > 1][:8].tolist()} "
                         "(each sample needs its own id; a sample seen twice would be reported once)")
    return ids


def all_gather_rows(ids: torch.Tensor, values: torch.Tensor, group, refusal: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """All-gathers per-rank rows of different counts: ids [B] as int64 (exact) beside float64 values
    [B, C] (their bits, exact), in one all-gather after one of the counts; returns (ids, values) on the CPU.
    `refusal`: why this rank's rows cannot be used (empty: they can); it travels with the counts, so that every
    rank raises the same ValueError, naming the ranks, rather than one raising while the others wait."""
    device = values.device if values.device.type != "cpu" or dist.get_backend(group) == "gloo" else torch.device("cuda")
    world = dist.get_world_size(group)
    sizes = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([ids.numel(), int(bool(refusal))], device=device), group=group)
    counts, refused = torch.stack(sizes).t().tolist()  # one host read for all ranks
    if any(refused):
        ranks = [r for r, bad in enumerate(refused) if bad]
        raise ValueError(f"{refusal or 'another rank refused its rows'} (rank(s) {ranks} of the group)")
    longest, columns = int(max(counts)), values.shape[1]
    padded = torch.zeros(1 + columns, longest, dtype=torch.int64, device=device)
    padded[0, : ids.numel()] = ids.to(device)
    padded[1:, : ids.numel()] = values.to(device, torch.float64).t().contiguous().view(torch.int64)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    gathered = torch.cat([p[:, : int(n)] for p, n in zip(parts, counts)], dim=1).cpu()
    return gathered[0], gathered[1:].contiguous().view(torch.float64).t()


def all_gather_varlen(ids: torch.Tensor, norms: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gathers per-rank vectors of different lengths: ids as int64 (exact), norms as float64, returned
    in the dtype of this rank's norms."""
    ids, values = all_gather_rows(ids, norms.reshape(-1, 1), group)
    return ids, values[:, 0].to(norms.dtype)


def by_global_id(ids: torch.Tensor, norms: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, norms) of every rank's samples, ordered by id, each id once (all-gathered over `group`, never
    summed: that would inflate norms by sqrt(world size); a sample several ranks saw appears once)."""
    if ids.numel() != norms.numel():
        raise ValueError(f"PerSampleGradNorms.global_norms: got {ids.numel()} sample ids for {norms.numel()} samples")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        ids, norms = all_gather_varlen(ids, norms, group)
    ids, rows = first_of_each_id(ids)
    return ids, norms[rows]
