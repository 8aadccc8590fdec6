"""Public statistics ops: the DTensor-aware front of the fused kernels (gapmon._backend).

Each op returns a `Stats` whose fields are float64 tensors on the input's device (counts exact up
to 2^53). DTensors give exact statistics of the full tensor on every rank (gapmon.distributed);
plain tensors go straight to the backend, which falls back to the pure-PyTorch reference where
the compiled kernels are missing.
"""
from __future__ import annotations

import numbers
from typing import Sequence

import torch

from ..utils import is_dtensor
from . import _backend, distributed
from ._backend import (  # noqa: F401
    accumulate_instance_stats,
    accumulate_instance_stats_and_numerics,
    accumulate_instance_stats_numerics_blocks,
    backend,
    cpu_isa,
    cuda_kernels_compiled,
)
from .layout import STAT_NAMES, Stats, tensor_list


def _correction(value, op: str) -> int:
    """The Bessel correction as an int (any integer, as torch.var takes it); TypeError naming the op otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"gapmon.{op}: correction must be an integer (1: Bessel's correction, 0: none), "
                        f"got {value!r} ({type(value).__name__})")
    return int(value)


def tensor_stats(x: torch.Tensor, correction: int = 1) -> Stats:
    """Count, mean, var (with `correction`), max|x|, L2 norm, non-finite and zero counts of `x`.

    One pass over memory for any float dtype and layout. A DTensor gives the statistics of the
    full tensor on every rank.
    """
    correction = _correction(correction, "tensor_stats")
    if is_dtensor(x):
        return Stats.from_rows(multi_tensor_rows([x], correction)[0])
    return Stats.from_rows(_backend.tensor_rows(x, correction))


def instance_stats(x: torch.Tensor, correction: int = 1) -> Stats:
    """Statistics of each x[b] along dim 0: every field has shape [x.shape[0]]."""
    correction = _correction(correction, "instance_stats")
    if is_dtensor(x):
        return distributed.dtensor_instance_stats(x, correction)
    return Stats.from_rows(_backend.instance_rows(x, correction))


def multi_tensor_stats(xs: Sequence[torch.Tensor], correction: int = 1) -> Stats:
    """Statistics of each of N tensors (mixed sizes and dtypes) in one launch: fields have shape [N]."""
    correction = _correction(correction, "multi_tensor_stats")
    return Stats.from_rows(multi_tensor_rows(xs, correction))


def multi_tensor_rows(xs: Sequence[torch.Tensor], correction: int = 1) -> torch.Tensor:
    """The [N, 7] float64 buffer behind `multi_tensor_stats` (columns in STAT_NAMES order), for
    callers that read every statistic at once, e.g. in one device-to-host copy."""
    correction = _correction(correction, "multi_tensor_rows")
    xs = tensor_list(xs, "multi_tensor_stats")
    if not xs:
        return torch.empty(0, len(STAT_NAMES), dtype=torch.float64)
    if distributed.is_sharded(xs, "multi_tensor_stats"):
        return _backend.finalize_rows(distributed.dtensor_multi_states(xs), correction)
    return _backend.multi_rows(xs, correction)  # one fused op: states and their finalisation


def update_rows(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor],
                grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """What an optimizer step did per parameter, in one read of the weights before and after it and of the
    gradients: [N, 5] float64 rows (layout.UPDATE_COLUMNS: |after - before|^2, |before|^2, |grad|^2,
    <after - before, grad>, count), of the full tensors for DTensors (FSDP2: the shards' sums added over
    the mesh; the gradient redistributed to its parameter's placements if they differ)."""
    before, after, grads = (tensor_list(t, "update_sums") for t in (before, after, grads))
    if any(is_dtensor(t) for t in before + after + grads):
        return distributed.dtensor_update_rows(before, after, grads)
    return _backend.update_sums(before, after, grads)


def multi_tensor_states(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mergeable partial states of local tensors: [N, 7] float64 (count, mean, m2, max_abs, sumsq,
    nonfinite, zeros). Merge partial states of pieces of a tensor with `merge_states`."""
    return _backend.multi_states(tensor_list(xs, "multi_tensor_states"))


def merge_states(states: torch.Tensor) -> torch.Tensor:
    """Merges [R, N, 7] partial states over R (in order) into [N, 7]."""
    return _backend.merge_states(states)


def finalize_states(states: torch.Tensor, correction: int = 1) -> Stats:
    """[N, 7] partial states -> Stats with [N] fields."""
    correction = _correction(correction, "finalize_states")
    return Stats.from_rows(finalize_rows(states, correction))


def finalize_rows(states: torch.Tensor, correction: int = 1) -> torch.Tensor:
    """[N, 7] partial states -> the [N, 7] float64 statistics buffer behind `finalize_states`."""
    correction = _correction(correction, "finalize_rows")
    return _backend.finalize_rows(states, correction)
