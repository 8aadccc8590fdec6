"""Public statistics ops: fused kernels from gapmon._C, with the pure-PyTorch reference as fallback.

Each op returns a `Stats` whose fields are float64 tensors on the input's device (counts exact up to
2^53). DTensors give exact statistics of the full tensor on every rank (see gapmon.distributed).
"""
from __future__ import annotations

import os
import warnings
from typing import Sequence

import torch

from . import reference
from .stats import Stats, check_same_device, check_states, check_tensor

_LIB = "gapmon"


def _load_extension() -> bool:
    if os.environ.get("GAPMON_BACKEND", "").lower() == "torch":
        return False
    try:
        from . import _C  # noqa: F401  (registers torch.ops.gapmon.*)
    except ImportError as e:
        warnings.warn(
            f"gapmon: compiled extension not available ({e}); using the slow pure-PyTorch reference. "
            "Build it with `pip install --no-build-isolation -e .`",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


_COMPILED = _load_extension()
_CUDA_KERNELS = _COMPILED and torch._C._dispatch_has_kernel_for_dispatch_key(f"{_LIB}::tensor_stats", "CUDA")


def backend() -> str:
    """The active backend: "cuda" (compiled, GPU present), "cpu" (compiled) or "torch" (fallback)."""
    if not _COMPILED:
        return "torch"
    return "cuda" if _CUDA_KERNELS and torch.cuda.is_available() else "cpu"


def _compiled_for(device: torch.device) -> bool:
    return _COMPILED and (device.type == "cpu" or (device.type == "cuda" and _CUDA_KERNELS))


def cpu_isa(request: str = "") -> str:
    """The CPU instruction set of the kernels ("avx512", "avx2", "generic"); selects one if given."""
    if not _COMPILED:
        return "torch"
    return torch.ops.gapmon._cpu_isa(request)


if _COMPILED:
    # Shapes of the outputs, for tracing (torch.compile, FakeTensor, meta).
    @torch.library.register_fake(f"{_LIB}::tensor_stats")
    def _(x, correction=1):
        return x.new_empty((7,), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::instance_stats")
    def _(x, correction=1):
        torch._check(x.dim() >= 1, lambda: "instance_stats expects a batch dimension")
        return x.new_empty((x.shape[0], 7), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::multi_tensor_stats")
    def _(xs, correction=1):
        return xs[0].new_empty((len(xs), 7), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::multi_tensor_states")
    def _(xs):
        return xs[0].new_empty((len(xs), 7), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::merge_states")
    def _(states):
        return states.new_empty((states.shape[1], 7), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::finalize_states")
    def _(states, correction=1):
        return states.new_empty((states.shape[0], 7), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::accumulate_instance_stats")
    def _(x, acc, row, correction=1):
        return None


def _is_dtensor(x) -> bool:
    return type(x).__name__ == "DTensor" and hasattr(x, "placements")


def tensor_stats(x: torch.Tensor, correction: int = 1) -> Stats:
    """Count, mean, var (with `correction`), max|x|, L2 norm, non-finite and zero counts of `x`.

    One pass over memory for any float dtype and layout. A DTensor gives the statistics of the
    full tensor on every rank.
    """
    if _is_dtensor(x):
        return Stats.from_rows(multi_tensor_rows([x], correction)[0])
    check_tensor(x, "tensor_stats")
    if not _compiled_for(x.device):
        return reference.tensor_stats(x, correction)
    return Stats.from_rows(torch.ops.gapmon.tensor_stats(x.detach(), correction))


def instance_stats(x: torch.Tensor, correction: int = 1) -> Stats:
    """Statistics of each x[b] along dim 0: every field has shape [x.shape[0]]."""
    if _is_dtensor(x):
        from .distributed import dtensor_instance_stats

        return dtensor_instance_stats(x, correction)
    check_tensor(x, "instance_stats")
    if not _compiled_for(x.device):
        return reference.instance_stats(x, correction)
    return Stats.from_rows(torch.ops.gapmon.instance_stats(x.detach(), correction))


def multi_tensor_stats(xs: Sequence[torch.Tensor], correction: int = 1) -> Stats:
    """Statistics of each of N tensors (mixed sizes and dtypes) in one launch: fields have shape [N]."""
    return Stats.from_rows(multi_tensor_rows(xs, correction))


def multi_tensor_rows(xs: Sequence[torch.Tensor], correction: int = 1) -> torch.Tensor:
    """The [N, 7] float64 buffer behind `multi_tensor_stats` (columns in STAT_NAMES order), for
    callers that read every statistic at once, e.g. in one device-to-host copy."""
    xs = list(xs)
    if not xs:
        return torch.empty(0, 7, dtype=torch.float64)
    for x in xs:
        check_tensor(x, "multi_tensor_stats")
    check_same_device(xs, "multi_tensor_stats")
    if any(_is_dtensor(x) for x in xs):
        from .distributed import dtensor_multi_states

        return finalize_rows(dtensor_multi_states(xs), correction)
    if not _compiled_for(xs[0].device):
        return reference.multi_tensor_stats(xs, correction).rows()
    return torch.ops.gapmon.multi_tensor_stats([x.detach() for x in xs], correction)


def multi_tensor_states(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mergeable partial states of local tensors: [N, 7] float64 (count, mean, m2, max_abs, sumsq,
    nonfinite, zeros). Merge partial states of pieces of a tensor with `merge_states`."""
    xs = list(xs)
    for x in xs:
        check_tensor(x, "multi_tensor_states")
    check_same_device(xs, "multi_tensor_states")
    xs = [x.detach() for x in xs]
    if not xs:
        return torch.empty(0, 7, dtype=torch.float64)
    if not _compiled_for(xs[0].device):
        return reference.multi_tensor_states(xs)
    return torch.ops.gapmon.multi_tensor_states(xs)


def merge_states(states: torch.Tensor) -> torch.Tensor:
    """Merges [R, N, 7] partial states over R (in order) into [N, 7]."""
    check_states(states, 3, "merge_states")
    if not _compiled_for(states.device):
        return reference.merge_states(states)
    return torch.ops.gapmon.merge_states(states)


def finalize_states(states: torch.Tensor, correction: int = 1) -> Stats:
    """[N, 7] partial states -> Stats with [N] fields."""
    return Stats.from_rows(finalize_rows(states, correction))


def finalize_rows(states: torch.Tensor, correction: int = 1) -> torch.Tensor:
    """[N, 7] partial states -> the [N, 7] float64 statistics buffer behind `finalize_states`."""
    check_states(states, 2, "finalize_states")
    if not _compiled_for(states.device):
        return reference.finalize_states(states, correction)
    return torch.ops.gapmon.finalize_states(states, correction)


def accumulate_instance_stats(x: torch.Tensor, acc: torch.Tensor, row: int, correction: int = 1) -> None:
    """Folds the per-instance statistics of x (dim 0 = instances) into row `row` of a float64
    [rows, 6] accumulator: instances, sum of means, sum of variances, sum of norms, non-finite
    count, max |x|. One fused op: what GAPMonitor runs in its activation hooks."""
    if not _compiled_for(x.device):
        reference.accumulate_instance_stats(x, acc, row, correction)
        return
    torch.ops.gapmon.accumulate_instance_stats(x, acc, row, correction)


# ------------------------------------------------------------------ per-sample norm products
def ghost_norm_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Σ_{t,s} (a_t·a_s)(g_t·g_s) per sample of a [B, T, d], g [B, T, p]: ||gᵀa||²_F via Grams."""
    if _COMPILED:
        return torch.ops.gapmon.ghost_norm_sq(a, g)
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))


def direct_norm_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """||g_bᵀ a_b||²_F per sample, forming the [p, d] per-sample products in bounded batches."""
    if _COMPILED:
        return torch.ops.gapmon.direct_norm_sq(a, g)
    return torch.bmm(g.transpose(1, 2), a).square().sum((1, 2))


def embedding_norm_sq(ids: torch.Tensor, g: torch.Tensor, padding_idx: int = -1) -> torch.Tensor:
    """Σ over positions t, s with equal ids (not padding_idx) of g_t·g_s, per sample."""
    if _COMPILED:
        return torch.ops.gapmon.embedding_norm_sq(ids, g, padding_idx)
    same = ids.unsqueeze(2) == ids.unsqueeze(1)
    if padding_idx >= 0:
        valid = ids != padding_idx
        same &= valid.unsqueeze(2) & valid.unsqueeze(1)
    return (torch.bmm(g, g.transpose(1, 2)) * same).sum((1, 2))
