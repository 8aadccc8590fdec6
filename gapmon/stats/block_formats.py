"""Per-block low-precision formats (SPEC section 10): what casting a tensor to MXFP8 (e4m3, e5m2), MXFP4,
NVFP4 or per-tensor current-scaled FP8 would do to it, emulated exactly on the bits (csrc/core/
block_formats.h; the float64 reference from the specifications is gapmon.stats.reference.block_numerics).

Blocks run along the last dim (a row's last block may be shorter; a 0-dim tensor is one element):
- ``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp4`` (OCP MX v1.0): 32-element blocks, an E8M0 scale 2^X per block,
  X = floor(log2(amax_b)) - emax (emax: 8, 15, 2), clamped to [-127, 127] (a clamped X is a scale
  under/overflow); elements x·2^-X (exact) cast to e4m3/e5m2/e2m1.
- ``nvfp4``: 16-element blocks of e2m1 with an e4m3 block scale S = e4m3(fp32(fp32(amax_b)/6)·g) under the
  per-tensor fp32 scale g = 448·6/amax (S below e4m3's smallest normal 2^-6 is a scale underflow; S = 0
  casts the block to zero); elements fp32(x·fp32(g/S)), dequantised q·S/g.
- ``fp8_e4m3_current``, ``fp8_e5m2_current``: one fp32 scale per tensor, s = max_finite/amax, as
  TransformerEngine's current scaling; elements fp32(x·s), dequantised q/s.

Every cast rounds to nearest, ties to even, on the format's grid, subnormals included, and saturates where the
rounded value is above the format's largest finite value (e4m3: 448, e5m2: 57344, e2m1: 6): ``saturated``
counts those clamped values, not those that merely round down to the largest one. Scales are computed in float32
as hardware does; float64 tensors keep the scaled value in float64. Non-finite elements are left out of
every count and sum (counted apart); amax is over the finite elements.

Per tensor and format (`block_metrics`): ``block_underflow`` (share of finite non-zero elements cast to
zero), ``subnormal`` (share cast to a non-zero subnormal), ``saturated`` (share clamped), ``scale_underflow``
and ``scale_overflow`` (shares of blocks), ``mse`` (mean of (x - dequantised)^2 over the finite elements),
``sqnr_db`` (10·log10(sum x^2 / sum error^2)), ``block_range_bits`` (the largest log2(amax_b / smallest
non-zero |x| of the block) over the format's blocks); and once per tensor ``range_bits``
(log2(amax / smallest non-zero |x|)).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..utils import is_dtensor
from . import _backend, distributed
from .distributed import merge_block_rows  # noqa: F401  (a public name of this module)
from .layout import BLOCK_COLUMNS, NUMERICS_COLUMNS, STAT_NAMES, STATE_NAMES, tensor_list

BLOCK_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4", "fp8_e4m3_current", "fp8_e5m2_current")
_CODE = {name: code for code, name in enumerate(BLOCK_FORMATS)}
_TENSOR_SCALED = {"nvfp4", "fp8_e4m3_current", "fp8_e5m2_current"}
_BLOCK_ELEMS = {"nvfp4": 16}  # the others: 32 (the current-scaling formats: for their block range only)
BLOCK_METRIC_FIELDS = ("block_underflow", "subnormal", "saturated", "scale_underflow", "scale_overflow", "mse",
                       "sqnr_db", "block_range_bits")
_COL = {name: i for i, name in enumerate(BLOCK_COLUMNS)}
_MAX_ABS, _NONFINITE = STAT_NAMES.index("max_abs"), STAT_NAMES.index("nonfinite")


def check_block_formats(formats: Sequence[str]) -> tuple[str, ...]:
    """The block format names, validated: ValueError naming the known ones otherwise."""
    if isinstance(formats, str):
        formats = (formats,)
    if formats is None or not isinstance(formats, (tuple, list)):
        raise TypeError(f"gapmon block formats: expected a sequence of format names (e.g. ('mxfp8_e4m3', 'nvfp4'), or "
                        f"() for none), got {formats!r}; known: {list(BLOCK_FORMATS)}")
    unknown = [f for f in formats if f not in _CODE]
    if unknown:
        raise ValueError(f"gapmon block formats: unknown format(s) {unknown}; known: {list(BLOCK_FORMATS)}")
    if len(set(formats)) != len(formats):
        raise ValueError(f"gapmon block formats: a format is named twice in {list(formats)}")
    return tuple(formats)


def needs_tensor_amax(fmt: str) -> bool:
    """Whether format `fmt` scales by the whole tensor's amax (NVFP4's fp32 scale, current scaling)."""
    return fmt in _TENSOR_SCALED


def format_codes(formats: Sequence[str]) -> list[int]:
    """The ops' codes of the named formats (checked: ValueError naming an unknown one)."""
    return [_CODE[f] for f in check_block_formats(formats)]


def finite_amaxes(xs: Sequence[torch.Tensor], stat_rows: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [N]: each tensor's largest finite |x| (of the full tensor for a DTensor). From statistics rows
    (max_abs, nonfinite) when given and the tensor is finite; else measured."""
    from .ops import multi_tensor_rows  # ops' DTensor front; not at the top: ops is the heavier module

    rows = stat_rows if stat_rows is not None else multi_tensor_rows(list(xs), 0)
    out = rows[:, _MAX_ABS].to(torch.float64).cpu().clone()
    for i in torch.nonzero(rows[:, _NONFINITE].cpu() > 0).flatten().tolist():
        x = xs[i]
        full = x.full_tensor() if is_dtensor(x) else x
        a = full.detach().abs().double()
        out[i] = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax().item() if a.numel() else 0.0
    return out


def block_numerics(xs: Sequence[torch.Tensor], formats: Sequence[str],
                   amaxes: torch.Tensor | None = None) -> torch.Tensor:
    """[N, F, len(BLOCK_COLUMNS)] float64 rows of N tensors cast to F block formats, in one read of each
    element (given the amaxes the per-tensor scaled formats need: measured first when not given). A DTensor
    gives the rows of its full tensor on every rank: shards that keep the blocks whole are merged over the
    mesh; a shard boundary inside a block (a 1-D tensor or a sharded last dim whose shards are not whole
    blocks) is handled exactly by casting the full tensor."""
    formats = check_block_formats(formats)
    xs = tensor_list(xs, "block_numerics")
    if not formats:
        raise ValueError("gapmon.block_numerics: name at least one format")
    if not xs:
        return torch.empty(0, len(formats), len(BLOCK_COLUMNS), dtype=torch.float64)
    if amaxes is None:
        amaxes = finite_amaxes(xs) if _TENSOR_SCALED & set(formats) else torch.zeros(len(xs), dtype=torch.float64)
    codes = [_CODE[f] for f in formats]
    if not any(is_dtensor(x) for x in xs):
        return _backend.block_numerics_rows(xs, codes, amaxes)
    return distributed.dtensor_block_rows(xs, codes, amaxes, max(_BLOCK_ELEMS.get(f, 32) for f in formats))


def states_numerics_blocks(xs: Sequence[torch.Tensor], formats: Sequence[str], numerics: bool = True,
                           amaxes: torch.Tensor | None = None, flat_groups: Sequence | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(statistics states [N, 7], numerics rows [N, C] or None without `numerics`, block rows [N, F, 12]) of N
    tensors, as multi_tensor_states, numerics_states and block_numerics give them, in one pass over each tensor
    (CPU: each chunk's numerics and blocks are taken while it is in cache; CUDA: one launch, each chunk read
    again from L2 by the block that has just read it for the statistics). The formats scaled per block (MX) are always
    cast in the pass; those scaled by the tensor's amax (NVFP4, current scaling) too when `amaxes` is given,
    else after it, with the amaxes the pass measured: a second read of the tensors, the price of a scale that
    depends on the whole tensor. DTensors and FSDP1 flat pieces (`flat_groups`) are merged over their groups
    with one collective; a DTensor whose shards cut blocks is cast whole; a flat piece's block rows are NaN
    (it has lost its parameter's shape)."""
    from .ops import finalize_rows

    formats = check_block_formats(formats)
    if not formats:
        raise ValueError("gapmon.states_numerics_blocks: name at least one format")
    xs = tensor_list(xs, "states_numerics_blocks")
    n_state, n_num, n_col = len(STATE_NAMES), (len(NUMERICS_COLUMNS) if numerics else 0), len(BLOCK_COLUMNS)
    in_pass = [f for f in formats if amaxes is not None or f not in _TENSOR_SCALED]
    if not xs:
        return (torch.empty(0, n_state, dtype=torch.float64), torch.empty(0, n_num, dtype=torch.float64) if numerics
                else None, torch.empty(0, len(formats), n_col, dtype=torch.float64))
    given = amaxes if amaxes is not None else torch.zeros(len(xs), dtype=torch.float64)
    if in_pass:
        codes, width = [_CODE[f] for f in in_pass], len(in_pass) * n_col

        def merge(parts: torch.Tensor) -> torch.Tensor:
            merged = [_backend.merge_states(parts[..., :n_state].contiguous())]
            if numerics:
                merged.append(_backend.merge_numerics_rows(parts[..., n_state:n_state + n_num].contiguous()))
            r, n = parts.shape[0], parts.shape[1]
            blocks = parts[..., n_state + n_num:].reshape(r, n, len(in_pass), n_col)
            return torch.cat(merged + [merge_block_rows(blocks).reshape(n, width)], dim=-1)

        rows = distributed.full_tensor_rows(
            xs, "states_numerics_blocks", lambda local: _backend.states_numerics_blocks_rows(local, numerics, codes, given),
            merge, flat_groups)
        blocks = rows[:, n_state + n_num:].reshape(len(xs), len(in_pass), n_col).clone()
        block = max(_BLOCK_ELEMS.get(f, 32) for f in in_pass)
        cut = [i for i, x in enumerate(xs) if is_dtensor(x) and not distributed.blocks_whole(x, block)]
        if cut:  # the shards' rows are not the tensor's: cast it whole
            blocks[cut] = distributed.dtensor_block_rows([xs[i] for i in cut], codes, given[cut], block).to(blocks.device)
    else:
        rows = (distributed.full_tensor_rows(xs, "states_and_numerics", _backend.states_and_numerics_rows,
                                             _backend.merge_states_and_numerics_rows, flat_groups) if numerics
                else distributed.dtensor_multi_states(xs, flat_groups))
        blocks = rows.new_empty(len(xs), 0, n_col)
    states = rows[:, :n_state].contiguous()
    numerics_rows = rows[:, n_state:n_state + n_num].contiguous() if numerics else None
    later = [f for f in formats if f not in in_pass]
    if later:
        measured = finite_amaxes(xs, finalize_rows(states, 0))
        blocks = torch.cat((blocks, block_numerics(xs, later, measured).to(blocks.device)), dim=1)
        order = [(in_pass + later).index(f) for f in formats]
        blocks = blocks[:, order]
    for i, group in enumerate(flat_groups or ()):
        if group is not None:
            blocks[i] = math.nan
    return states, numerics_rows, blocks.contiguous()


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else math.nan


def block_metrics(row: Sequence[float], numel: int) -> dict[str, float]:
    """The metrics (BLOCK_METRIC_FIELDS) of one format's row of a tensor of `numel` elements."""
    c = {name: row[i] for name, i in _COL.items()}
    finite = numel - c["nonfinite"]
    error, signal = c["error_sq"], c["signal_sq"]
    return {
        "block_underflow": _share(c["to_zero"], c["nonzero"]),
        "subnormal": _share(c["subnormal"], c["nonzero"]),
        "saturated": _share(c["saturated"], c["nonzero"]),
        "scale_underflow": _share(c["scale_underflow"], c["blocks"]),
        "scale_overflow": _share(c["scale_overflow"], c["blocks"]),
        "mse": error / finite if finite > 0 else math.nan,
        "sqnr_db": (10 * math.log10(signal / error) if error > 0 else math.inf) if signal > 0 else math.nan,
        "block_range_bits": math.log2(c["max_block_ratio"]) if c["max_block_ratio"] > 0 else math.nan,
    }


def range_bits(amax: float, row: Sequence[float]) -> float:
    """log2(amax / smallest non-zero |x|) of a tensor (any of its format rows holds the minimum); NaN when
    it has no finite non-zero element."""
    smallest = row[_COL["min_nonzero"]]
    return math.log2(amax / smallest) if amax > 0 and math.isfinite(smallest) else math.nan


def block_format_metrics(xs: Sequence[torch.Tensor], formats: Sequence[str]) -> list[dict[str, object]]:
    """Per tensor: {format: {field: value} (BLOCK_METRIC_FIELDS), "range_bits": value}, from one read of each
    element (and its amax, from a statistics pass, for the per-tensor scaled formats)."""
    formats = check_block_formats(formats)
    xs = tensor_list(xs, "block_format_metrics")
    amaxes = finite_amaxes(xs)
    rows = block_numerics(xs, formats, amaxes).cpu().tolist()
    out: list[dict[str, object]] = []
    for x, amax, per_format in zip(xs, amaxes.tolist(), rows):
        entry: dict[str, object] = {fmt: block_metrics(row, x.numel()) for fmt, row in zip(formats, per_format)}
        entry["range_bits"] = range_bits(amax, per_format[0])
        out.append(entry)
    return out
