"""The `Stats` result type shared by every backend."""
from __future__ import annotations

from typing import NamedTuple

import torch

# Column order of the [..., 7] statistics rows the kernels return (csrc/core/stats_state.h).
STAT_NAMES = ("count", "mean", "var", "max_abs", "norm", "nonfinite", "zeros")
# Column order of the [..., 7] float64 mergeable partial states.
STATE_NAMES = ("count", "mean", "m2", "max_abs", "sumsq", "nonfinite", "zeros")
# Columns of an optimizer-update row (update_sums; csrc/core/update_stats.h): |after - before|^2, |before|^2,
# |grad|^2, <after - before, grad>, elements. All additive over the pieces of a sharded tensor.
# Columns of a per-block format row (block_numerics; csrc/core/block_formats.h kBlockColumnNames).
BLOCK_COLUMNS = ("nonzero", "to_zero", "subnormal", "saturated", "blocks", "scale_underflow", "scale_overflow",
                 "error_sq", "signal_sq", "min_nonzero", "max_block_ratio", "nonfinite")
UPDATE_COLUMNS = ("update_sq", "weight_sq", "grad_sq", "update_dot_grad", "count")
# Columns of a GAPMonitor activation accumulator row: per-instance statistics folded together
# (sums over instances; divided by the instance count when the step ends).
ACC_NAMES = ("instances", "sum_mean", "sum_var", "sum_norm", "nonfinite", "max_abs")
# Columns of a numerics row (csrc/core/numerics.h, gapmon.numerics): the exponent-histogram bins of
# |x| (zero, float32 subnormal, one per frexp exponent EXP_MIN..EXP_MAX, inf, nan, then the two only
# float64 values reach: tiny, 0 < |x| < 2^-149, and huge, finite |x| >= 2^128), then the moments.
EXP_MIN, EXP_MAX = -125, 128
BIN_NAMES = ("zero", "subnormal", *(f"e{e}" for e in range(EXP_MIN, EXP_MAX + 1)), "inf", "nan", "tiny", "huge")
BIN = {name: i for i, name in enumerate(BIN_NAMES)}  # column of each bin
NUM_BINS = len(BIN_NAMES)
MOMENT_NAMES = ("count", "mean", "m2", "m3", "m4")
NUMERICS_COLUMNS = BIN_NAMES + MOMENT_NAMES


class Stats(NamedTuple):
    """Statistics of a tensor (0-dim fields) or of a batch of tensors ([N] fields), float64.

    Counts (``count``, ``nonfinite``, ``zeros``) are exact up to 2^53 elements.

    ``var`` uses the requested Bessel correction; ``max_abs`` is max |x|; ``norm`` is the L2 norm;
    ``nonfinite`` counts NaN and +-Inf; ``zeros`` counts exact zeros.
    """

    count: torch.Tensor
    mean: torch.Tensor
    var: torch.Tensor
    max_abs: torch.Tensor
    norm: torch.Tensor
    nonfinite: torch.Tensor
    zeros: torch.Tensor

    @classmethod
    def from_rows(cls, rows: torch.Tensor) -> "Stats":
        """Views the columns of a [..., 7] statistics buffer as fields (no copy)."""
        return cls._make(rows.unbind(-1))

    def rows(self) -> torch.Tensor:
        """The fields stacked back into a [..., 7] buffer."""
        return torch.stack(tuple(self), dim=-1)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_same_device(xs, op: str) -> None:
    """Raises ValueError unless every tensor of `xs` is on one device (one launch reads them all)."""
    devices = {x.device for x in xs}
    if len(devices) > 1:
        raise ValueError(f"gapmon.{op}: all tensors must be on one device, got {sorted(map(str, devices))}; "
                         "call it once per device")


def check_states(states, dims: int, op: str) -> None:
    """Raises TypeError/ValueError unless `states` are float64 partial states with `dims` dims
    ([parts, tensors, 7] for merge_states, [tensors, 7] for finalize_states). Checked before any
    kernel runs, in every build."""
    if not isinstance(states, torch.Tensor):
        raise TypeError(f"gapmon.{op}: expected a torch.Tensor of partial states, got {type(states).__name__}")
    shape = "[parts, tensors, 7]" if dims == 3 else "[tensors, 7]"
    if states.dtype != torch.float64 or states.dim() != dims or states.shape[-1] != len(STATE_NAMES):
        raise ValueError(f"gapmon.{op}: expected float64 {shape} states (from multi_tensor_states), "
                         f"got {states.dtype} {list(states.shape)}")


def tensor_list(xs, op: str) -> list:
    """`xs` (a sequence of tensors) as a list. A bare tensor is refused, as torch's _foreach ops refuse it:
    iterating it would silently measure each of its rows as a tensor of its own."""
    if isinstance(xs, torch.Tensor):
        raise TypeError(f"gapmon.{op}: expected a list of tensors, got one tensor of shape {tuple(xs.shape)}; pass "
                        "[x] (or list(x) to measure each of its rows apart)")
    return list(xs)


def check_tensor_list(xs: list, op: str) -> set[type]:
    """check_tensor and check_same_device over a list, in one pass that reads each tensor's type,
    dtype, layout and device once (the per-tensor checks, with their messages, run only when
    something is off). Returns the tensor types seen (to spot DTensors without another pass). While
    torch.compile traces (a monitor's hooks) nothing is read: the ops check their inputs themselves,
    and a traced backward hook may not read a tensor's layout (a graph break)."""
    if torch.compiler.is_compiling():
        return {type(x) for x in xs}
    try:
        kinds = {(type(x), x.dtype, x.layout, x.device) for x in xs}
    except AttributeError:  # not a tensor: the per-tensor check names it
        kinds = None
    if kinds is None or len({device for *_, device in kinds}) > 1 or not all(
            issubclass(kind, torch.Tensor) and dtype in FLOAT_DTYPES and layout == torch.strided and device.type != "meta"
            for kind, dtype, layout, device in kinds):
        for x in xs:
            check_tensor(x, op)
        check_same_device(xs, op)
    return {kind for kind, *_ in kinds}


def check_tensor(x: torch.Tensor, op: str) -> None:
    """Raises TypeError (naming dtype or layout) for a tensor the statistics cannot read, and
    ValueError for a meta tensor (it has no data to measure)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gapmon.{op}: expected a torch.Tensor, got {type(x).__name__}")
    if x.device.type == "meta":
        raise ValueError(f"gapmon.{op}: a meta tensor has no data to measure; materialize it first (e.g. to_empty + init)")
    if x.layout != torch.strided:
        raise TypeError(f"gapmon.{op}: expected a dense (strided) tensor, got layout {x.layout}; call .to_dense() first")
    if x.is_quantized:
        raise TypeError(f"gapmon.{op}: quantized tensors ({x.dtype}) are not supported; call .dequantize() first")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"gapmon.{op}: expected a floating-point tensor (float16, bfloat16, float32 or float64), got dtype {x.dtype}"
        )
