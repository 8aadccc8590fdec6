"""Low-precision numerics of tensors: exponent histograms, bf16/fp16/fp8 underflow and overflow
shares, and kurtosis, exact and mergeable across shards and ranks (SPEC section 10).

The compiled kernels (csrc/core/numerics.h) return one float64 row per tensor: the histogram of
|x| over exponent bins, then count, mean and the central moments M2, M3, M4. Everything else here
is derived from those rows, exactly, because the format thresholds used are powers of two.

Bins: ``zero``; ``subnormal`` (float32 subnormals, 2^-149 <= |x| < 2^-126); ``e`` for each frexp
exponent e = -125..128, holding |x| in [2^(e-1), 2^e); ``inf``; ``nan``; and two that only float64
values reach: ``tiny`` (0 < |x| < 2^-149) and ``huge`` (finite |x| >= 2^128). float16/bfloat16 values
are widened to float32 exactly.

Shares, of all elements, for a format with smallest normal 2^a and largest finite value in the
binade [2^(E-1), 2^E), at a power-of-two scale s = 2^k (values are multiplied by s before the cast):
- ``underflow``: finite non-zero values with |x·s| < 2^a: they become subnormal or zero in the
  format (round to nearest even), losing precision or vanishing. Values below 2^-126 (float32
  subnormals, float64 tiny values) count as underflowing unless the scale lifts their whole bin to 2^a
  or above (never for tiny): where the scale splits the bin, the underflow share is an upper bound.
- ``overflow``: finite values with |x·s| >= 2^E, beyond the format's largest binade: they round to
  Inf (bf16, fp16, e5m2) or saturate (e4m3). Values between the format's largest finite value and
  2^E (e4m3: [448, 512); fp16: [65520, 65536)) also overflow but share their bin with values that
  do not: they are not counted.
- ``*_scaled``: the same at the power-of-two scale of MX formats (OCP MX v1.0): s = 2^k with
  k = E - e_max - margin, e_max the exponent bin of the tensor's largest finite |x|, so that amax·s
  lands in the format's largest binade (``margin`` binades lower). Unscaled: k = 0. Every unscaled share
  is exact; the scaled ones are exact when the largest finite |x| lies in [2^-126, 2^128) and no value
  lies below 2^-126 in a bin the scale splits. With float64 values at or above 2^128, e_max is taken as
  129 (its least possible value): underflow_scaled is then a lower bound; with only float64 values below
  2^-149, k = 0.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from ..utils import check_int
from . import _backend, distributed
from .layout import BIN, BIN_NAMES, EXP_MAX, EXP_MIN, MOMENT_NAMES, NUM_BINS, NUMERICS_COLUMNS, STATE_NAMES, check_tensor_list, tensor_list  # noqa: F401

_FIRST_EXP = 2  # column of bin e = EXP_MIN


class Format(NamedTuple):
    """A floating-point format's range as exponents: smallest normal 2^min_normal_exp, largest finite
    value `max_finite` in the binade [2^(top_exp-1), 2^top_exp)."""

    name: str
    min_normal_exp: int
    top_exp: int
    max_finite: float


FORMATS = {
    "bf16": Format("bf16", -126, 128, float(torch.finfo(torch.bfloat16).max)),
    "fp16": Format("fp16", -14, 16, float(torch.finfo(torch.float16).max)),
    "fp8_e4m3": Format("fp8_e4m3", -6, 9, 448.0),
    "fp8_e5m2": Format("fp8_e5m2", -14, 16, 57344.0),
}


def check_formats(formats: Sequence[str]) -> tuple[str, ...]:
    """The format names, validated: ValueError naming the known ones otherwise."""
    if isinstance(formats, str):
        formats = (formats,)
    if formats is None or not isinstance(formats, (tuple, list, set, frozenset)):
        raise TypeError(f"gapmon numerics: the formats must be a sequence of format names (e.g. ('bf16', 'fp8_e4m3'), "
                        f"or () for none), got {formats!r} ({type(formats).__name__}); known: {sorted(FORMATS)}")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"gapmon numerics: unknown format(s) {unknown}; known: {sorted(FORMATS)}")
    return tuple(formats)


def numerics_states(xs: Sequence[torch.Tensor], flat_groups: Sequence | None = None) -> torch.Tensor:
    """[N, len(NUMERICS_COLUMNS)] float64 numerics rows of N tensors (one parallel pass over each).
    A DTensor gives the row of its full tensor on every rank (shards merged over the mesh);
    `flat_groups[i]`, if not None, is the process group over which plain tensor i is split (FSDP1)."""
    xs = tensor_list(xs, "numerics_states")
    if not xs:
        return torch.empty(0, len(NUMERICS_COLUMNS), dtype=torch.float64)
    return distributed.full_tensor_rows(xs, "numerics_states", _backend.numerics_rows, _backend.merge_numerics_rows,
                                        flat_groups)


def states_and_numerics(xs: Sequence[torch.Tensor], flat_groups: Sequence | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(statistics states [N, 7], numerics rows [N, C]) of N tensors, as multi_tensor_states and
    numerics_states give them, in one pass over each tensor (each chunk's numerics are taken while it
    is in cache; on CUDA one launch). DTensors and FSDP1 flat pieces are merged over their groups with
    one collective for both."""
    xs = tensor_list(xs, "states_and_numerics")
    width = len(STATE_NAMES)
    if not xs:
        return torch.empty(0, width, dtype=torch.float64), torch.empty(0, len(NUMERICS_COLUMNS), dtype=torch.float64)
    rows = distributed.full_tensor_rows(xs, "states_and_numerics", _backend.states_and_numerics_rows,
                                        _backend.merge_states_and_numerics_rows, flat_groups)
    return rows[:, :width].contiguous(), rows[:, width:].contiguous()


def merge_numerics_states(states: torch.Tensor) -> torch.Tensor:
    """Merges [R, N, C] numerics rows of R pieces of N tensors (in order) into [N, C]."""
    return _backend.merge_numerics_rows(states)


def exponent_histogram(x: torch.Tensor) -> torch.Tensor:
    """int64 [NUM_BINS] histogram of |x| over BIN_NAMES (exact counts)."""
    return numerics_states([x])[0, :NUM_BINS].to(torch.int64)


def kurtosis(rows: torch.Tensor) -> torch.Tensor:
    """Pearson's kurtosis n·M4/M2² of numerics rows (3 for a normal distribution); NaN when the
    values are constant or there are none."""
    count, m2, m4 = rows[..., NUM_BINS], rows[..., NUM_BINS + 2], rows[..., NUM_BINS + 4]
    return torch.where(m2 > 0, count * m4 / (m2 * m2), torch.full_like(m2, math.nan))


def _exponents(device) -> torch.Tensor:
    return torch.arange(EXP_MIN, EXP_MAX + 1, device=device)


def top_exponent(rows: torch.Tensor) -> torch.Tensor:
    """Exponent bin of each row's largest finite |x|: EXP_MAX + 1 when float64 values at or above 2^128
    are present (their exponent is at least that), EXP_MIN - 1 for float32 subnormals only, and a very
    small number when there are no finite non-zero values or only float64 ones below 2^-149."""
    bins = rows[..., _FIRST_EXP:_FIRST_EXP + EXP_MAX - EXP_MIN + 1] > 0
    e = torch.where(bins, _exponents(rows.device), torch.full_like(bins, -10**6, dtype=torch.int64)).amax(-1)
    e = torch.where((e < EXP_MIN) & (rows[..., BIN["subnormal"]] > 0), torch.full_like(e, EXP_MIN - 1), e)
    return torch.where(rows[..., BIN["huge"]] > 0, torch.full_like(e, EXP_MAX + 1), e)


def format_shares(rows: torch.Tensor, fmt: str, scale_exp: torch.Tensor | int = 0) -> dict[str, torch.Tensor]:
    """{"underflow", "overflow"} shares of all elements of each row at scale 2^scale_exp (see the
    module docstring for the exact definitions); NaN for an empty tensor."""
    f = FORMATS[check_formats((fmt,))[0]]
    k = torch.as_tensor(scale_exp, device=rows.device).unsqueeze(-1)
    exps = _exponents(rows.device)
    counts = rows[..., _FIRST_EXP:_FIRST_EXP + exps.numel()]
    scaled = exps + k  # bin e holds [2^(e-1), 2^e); scaled, [2^(e-1+k), 2^(e+k))
    under = (counts * (scaled <= f.min_normal_exp)).sum(-1)
    k0 = k.squeeze(-1)
    # float32 subnormals lie in [2^-149, 2^-126): below 2^a unless the scale lifts the whole bin (a bound
    # where the scale splits it: docs/numerics.md); float64 values below 2^-149 count as underflowing (exact
    # unscaled, where k <= a + 149, a bound beyond).
    under = under + rows[..., BIN["subnormal"]] * ((k0 - 149) < f.min_normal_exp) + rows[..., BIN["tiny"]]
    # float64 values at or above 2^128 overflow every format unscaled; the MX scale takes the largest
    # into the top binade, which is not counted.
    over = (counts * (scaled - 1 >= f.top_exp)).sum(-1) + rows[..., BIN["huge"]] * (128 + k0 >= f.top_exp)
    total = rows[..., NUM_BINS]
    nan = torch.full_like(total, math.nan)
    return {"underflow": torch.where(total > 0, under / total, nan), "overflow": torch.where(total > 0, over / total, nan)}


def mx_scale_exp(rows: torch.Tensor, fmt: str, margin: int = 0) -> torch.Tensor:
    """k of the MX power-of-two scale 2^k that puts each row's largest finite |x| in the format's
    largest binade, `margin` binades lower (0 where a row has no finite non-zero value)."""
    f = FORMATS[check_formats((fmt,))[0]]
    margin = check_int(margin, "gapmon numerics", "margin (binades below the format's top)")
    top = top_exponent(rows)
    return torch.where(top >= EXP_MIN - 1, f.top_exp - top - margin, torch.zeros_like(top))


class Numerics(NamedTuple):
    """Numerics of N tensors: exponent histograms [N, NUM_BINS] (int64), kurtosis [N], and per format
    {"underflow", "overflow", "underflow_scaled", "overflow_scaled"} shares [N] (float64)."""

    histogram: torch.Tensor
    kurtosis: torch.Tensor
    shares: dict[str, dict[str, torch.Tensor]]


def numerics_from_rows(rows: torch.Tensor, formats: Sequence[str] = tuple(FORMATS), margin: int = 0) -> Numerics:
    """Numerics of numerics rows (from numerics_states)."""
    margin = check_int(margin, "gapmon numerics", "margin (binades below the format's top)")
    shares = {}
    for fmt in check_formats(formats):
        plain = format_shares(rows, fmt)
        scaled = format_shares(rows, fmt, mx_scale_exp(rows, fmt, margin))
        shares[fmt] = {**plain, "underflow_scaled": scaled["underflow"], "overflow_scaled": scaled["overflow"]}
    return Numerics(rows[..., :NUM_BINS].to(torch.int64), kurtosis(rows), shares)


def multi_tensor_numerics(xs: Sequence[torch.Tensor], formats: Sequence[str] = tuple(FORMATS),
                          margin: int = 0) -> Numerics:
    """Exponent histograms, kurtosis and per-format underflow/overflow shares of N tensors (mixed
    sizes, dtypes, DTensors), from one pass over each."""
    xs = tensor_list(xs, "multi_tensor_numerics")
    formats = check_formats(formats)  # before the pass: a bad argument costs no read of the tensors
    margin = check_int(margin, "gapmon.multi_tensor_numerics", "margin (binades below the format's top)")
    return numerics_from_rows(numerics_states(xs), formats, margin)


# -------------------------------------------------------------------- histograms as records
_EXP_BINS = {name: i for i, name in enumerate(BIN_NAMES)}


def sparse_histogram(counts: Sequence[float]) -> dict[str, int]:
    """The non-zero bins of a [NUM_BINS] histogram by name ({"e-3": 1200, "zero": 5}): what a
    metrics record holds (a dozen bins, not 258)."""
    return {name: int(c) for name, c in zip(BIN_NAMES, counts) if c}


def dense_histogram(bins: dict[str, int]) -> list[int]:
    """[NUM_BINS] counts of a sparse histogram; KeyError naming an unknown bin."""
    out = [0] * NUM_BINS
    for name, count in bins.items():
        if name not in _EXP_BINS:
            raise KeyError(f"gapmon numerics: unknown histogram bin {name!r}; bins are {BIN_NAMES[0]}, "
                           f"{BIN_NAMES[1]}, e{EXP_MIN}..e{EXP_MAX}, inf, nan")
        out[_EXP_BINS[name]] += int(count)
    return out


def histogram_rows(histograms: Sequence[dict[str, int]]) -> torch.Tensor:
    """Numerics rows (bins and count; no moments) of sparse histograms, for format_shares."""
    rows = torch.zeros(len(histograms), len(NUMERICS_COLUMNS), dtype=torch.float64)
    for i, bins in enumerate(histograms):
        rows[i, :NUM_BINS] = torch.tensor(dense_histogram(bins), dtype=torch.float64)
    rows[:, NUM_BINS] = rows[:, :NUM_BINS].sum(1)
    return rows


def log2_buckets(bins: dict[str, int]) -> tuple[list[float], list[int]]:
    """(edges, counts) of the finite non-zero values of a sparse histogram on the log2|x| axis, for
    histogram sinks: bin e is [e-1, e); float32 subnormals are one bucket [-149, -126). Contiguous
    from the lowest to the highest bin present; zeros, infinities and NaNs are not on this axis (the
    monitor's scalars count them). ([], []) when there are none."""
    dense = dense_histogram(bins)
    present = [i for i in range(BIN["subnormal"], BIN["inf"]) if dense[i]]
    if not present:
        return [], []
    lo, hi = present[0], present[-1]
    edges = [-149.0] if lo == 1 else []
    edges += [float(EXP_MIN + i - _FIRST_EXP - 1) for i in range(max(lo, _FIRST_EXP), hi + 1)]
    edges.append(float(EXP_MIN + hi - _FIRST_EXP) if hi >= _FIRST_EXP else -126.0)
    return edges, dense[lo:hi + 1]
