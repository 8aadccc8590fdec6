"""Pure-PyTorch statistics: the slow, obviously-correct way.

This module is the fallback backend when the compiled extension is missing and the baseline
that tests and benchmarks compare the fused kernels against. Each statistic is a separate
torch op (one or more passes over memory each); half-precision inputs are upcast to float32.
"""
from __future__ import annotations

import math
import warnings
from typing import Sequence

import torch

from .layout import ACC_NAMES, BIN, BLOCK_COLUMNS, EXP_MAX, EXP_MIN, NUM_BINS, NUMERICS_COLUMNS, STAT_NAMES, Stats, check_tensor


def _acc(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    return x if x.dtype == torch.float64 else x.float()


def _rows(xf: torch.Tensor, correction: int) -> torch.Tensor:
    """Statistics of each row of a 2-D tensor, as a [rows, 7] float64 buffer (exact counts)."""
    n = xf.shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about dof <= 0, which is defined here
        var, mean = torch.var_mean(xf, dim=1, correction=correction)
    if n == 0:
        max_abs = xf.new_zeros(xf.shape[0])
    else:
        max_abs = xf.abs().amax(dim=1)
    # summed in float64: float32's own sum on one thread (no per-thread chunks) is off by ~1e-5 at 10^5 elements
    norm = torch.linalg.vector_norm(xf, dim=1, dtype=torch.float64)
    nonfinite = (~torch.isfinite(xf)).sum(dim=1)
    zeros = (xf == 0).sum(dim=1)
    count = torch.full_like(mean, n, dtype=torch.float64)
    cols = (count, mean.double(), var.double(), max_abs.double(), norm.double(), nonfinite.double(), zeros.double())
    return torch.stack(cols, dim=1)


def tensor_stats(x: torch.Tensor, correction: int = 1) -> Stats:
    check_tensor(x, "tensor_stats")
    return Stats.from_rows(_rows(_acc(x).reshape(1, -1), correction)[0])


def instance_stats(x: torch.Tensor, correction: int = 1) -> Stats:
    check_tensor(x, "instance_stats")
    if x.dim() == 0:
        raise ValueError("gapmon.instance_stats: expected a tensor with a batch dimension (ndim >= 1), got a 0-dim tensor")
    return Stats.from_rows(_rows(_acc(x).reshape(x.shape[0], -1), correction))


def multi_tensor_stats(xs: Sequence[torch.Tensor], correction: int = 1) -> Stats:
    for x in xs:
        check_tensor(x, "multi_tensor_stats")
    if len(xs) == 0:
        return Stats.from_rows(torch.empty(0, len(STAT_NAMES), dtype=torch.float64))
    return Stats.from_rows(torch.stack([_rows(_acc(x).reshape(1, -1), correction)[0] for x in xs]))


def multi_tensor_states(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mergeable partial states ([N, 7] float64: count, mean, m2, max_abs, sumsq, nonfinite, zeros)."""
    out = []
    for x in xs:
        check_tensor(x, "multi_tensor_states")
        xf = x.detach().reshape(-1).double()
        n = xf.numel()
        if n == 0:
            out.append(torch.zeros(7, dtype=torch.float64, device=x.device))
            continue
        mean = xf.mean()
        m2 = ((xf - mean) ** 2).sum()
        cols = (torch.tensor(float(n), dtype=torch.float64, device=x.device), mean, m2, xf.abs().amax(),
                (xf * xf).sum(), (~torch.isfinite(xf)).sum().double(), (xf == 0).sum().double())
        out.append(torch.stack(cols))
    return torch.stack(out) if out else torch.empty(0, 7, dtype=torch.float64)


def merge_states(states: torch.Tensor) -> torch.Tensor:
    """Merges [R, N, 7] partial states over R into [N, 7] (Chan et al.), in order."""
    n, mean, m2, mx, sq, nf, nz = states[0].unbind(-1)
    for part in states[1:]:
        nb, mb, m2b, mxb, sqb, nfb, nzb = part.unbind(-1)
        total = n + nb
        safe = torch.where(total > 0, total, torch.ones_like(total))
        delta = mb - mean
        new_mean = torch.where(nb == 0, mean, torch.where(n == 0, mb, (n * mean + nb * mb) / safe))
        new_m2 = torch.where(nb == 0, m2, torch.where(n == 0, m2b, m2 + m2b + delta * delta * n * nb / safe))
        nan_max = torch.where(torch.isnan(mx) | torch.isnan(mxb), torch.full_like(mx, float("nan")), torch.maximum(mx, mxb))
        n, mean, m2, mx, sq, nf, nz = total, new_mean, new_m2, nan_max, sq + sqb, nf + nfb, nz + nzb
    return torch.stack((n, mean, m2, mx, sq, nf, nz), dim=-1)


def finalize_states(states: torch.Tensor, correction: int = 1) -> torch.Tensor:
    """[N, 7] partial states -> [N, 7] float64 statistics rows."""
    n, mean, m2, mx, sq, nf, nz = states.unbind(-1)
    nan = torch.full_like(n, float("nan"))
    dof = (n - correction).clamp(min=0)
    var = torch.where(n > 0, m2 / dof, nan)
    return torch.stack((n, torch.where(n > 0, mean, nan), var, mx, sq.sqrt(), nf, nz), dim=-1)


def accumulate_instance_stats(x: torch.Tensor, acc: torch.Tensor, row: int, correction: int = 1) -> None:
    """Per-instance statistics of x folded into row `row` of a [rows, len(ACC_NAMES)] float64 accumulator."""
    s = instance_stats(x, correction)
    col = {name: i for i, name in enumerate(ACC_NAMES)}
    for name, value in (("instances", float(x.shape[0])), ("sum_mean", s.mean.sum()), ("sum_var", s.var.sum()),
                        ("sum_norm", s.norm.sum()), ("nonfinite", s.nonfinite.sum())):
        acc[row, col[name]] += value
    m = s.max_abs.amax().to(acc.device) if x.shape[0] > 0 else acc.new_zeros(())
    old = acc[row, col["max_abs"]]
    acc[row, col["max_abs"]] = torch.where(torch.isnan(m) | torch.isnan(old), torch.nan, torch.maximum(old, m))


def numerics_states(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """[N, C] numerics rows (gapmon.numerics): frexp exponent histogram of |x| by bincount, and the
    central moments in float64 from the mean (two passes)."""
    out = []
    for x in xs:
        check_tensor(x, "numerics_states")
        xd = x.detach().reshape(-1).double()  # exact for every float dtype
        a = xd.abs()
        finite, zero = torch.isfinite(a), a == 0
        _, e = torch.frexp(torch.where(finite & ~zero, a, torch.ones_like(a)))
        e = e.long()
        idx = torch.where(e < EXP_MIN, torch.where(e >= -148, BIN["subnormal"], BIN["tiny"]),
                          torch.where(e > EXP_MAX, BIN["huge"], BIN["e0"] + e.clamp(EXP_MIN, EXP_MAX)))
        idx = torch.where(zero, BIN["zero"], idx)
        idx = torch.where(torch.isinf(a), BIN["inf"], torch.where(torch.isnan(a), BIN["nan"], idx))
        row = torch.zeros(len(NUMERICS_COLUMNS), dtype=torch.float64, device=x.device)
        row[:NUM_BINS] = torch.bincount(idx, minlength=NUM_BINS).double()
        if xd.numel():
            mean = xd.mean()
            d = xd - mean
            row[NUM_BINS:] = torch.stack((torch.tensor(float(xd.numel()), dtype=torch.float64, device=x.device), mean,
                                          (d ** 2).sum(), (d ** 3).sum(), (d ** 4).sum()))
        out.append(row)
    return torch.stack(out) if out else torch.empty(0, len(NUMERICS_COLUMNS), dtype=torch.float64)


def merge_numerics_states(states: torch.Tensor) -> torch.Tensor:
    """Merges [R, N, C] numerics rows over R in order: bins add, moments by Pebay's formulas."""
    bins = states[..., :NUM_BINS].sum(0)
    n, mean, m2, m3, m4 = states[0, :, NUM_BINS:].unbind(-1)
    for part in states[1:]:
        nb, mb, m2b, m3b, m4b = part[:, NUM_BINS:].unbind(-1)
        total = n + nb
        safe = torch.where(total > 0, total, torch.ones_like(total))
        delta = mb - mean
        dn = delta / safe
        new = (total, mean + nb * dn, m2 + m2b + delta * dn * n * nb,
               m3 + m3b + delta * dn * dn * n * nb * (n - nb) + 3 * dn * (n * m2b - nb * m2),
               m4 + m4b + delta * dn ** 3 * n * nb * (n * n - n * nb + nb * nb) + 6 * dn * dn * (n * n * m2b + nb * nb * m2)
               + 4 * dn * (n * m3b - nb * m3))
        keep_a, keep_b = nb == 0, n == 0
        n, mean, m2, m3, m4 = (torch.where(keep_a, a, torch.where(keep_b, b, c))
                               for a, b, c in zip((n, mean, m2, m3, m4), (nb, mb, m2b, m3b, m4b), new))
    return torch.cat((bins, torch.stack((n, mean, m2, m3, m4), dim=-1)), dim=-1)


def accumulate_instance_stats_and_numerics(x: torch.Tensor, acc: torch.Tensor, row: int, correction: int,
                                           numerics: torch.Tensor, numerics_row: int) -> None:
    """accumulate_instance_stats, and x's numerics row merged into row `numerics_row` of a [rows, C]
    float64 table in place (after what the row holds)."""
    accumulate_instance_stats(x, acc, row, correction)
    old = numerics[numerics_row].clone()
    numerics[numerics_row] = merge_numerics_states(torch.stack((old, numerics_states([x])[0].to(numerics.device))).unsqueeze(1))[0]


def accumulate_instance_stats_numerics_blocks(x: torch.Tensor, acc: torch.Tensor, row: int, correction: int,
                                              numerics_on: bool, numerics: torch.Tensor, numerics_row: int,
                                              codes: Sequence[int], amax: torch.Tensor | None, blocks: torch.Tensor,
                                              blocks_row: int) -> None:
    """accumulate_instance_stats (and_numerics with `numerics_on`), and x's block-format rows merged into row
    `blocks_row` of a [rows, F, C] float64 table in place (sums added, min_nonzero the smaller, max_block_ratio
    the larger); `amax` None: x's largest finite |x|."""
    if numerics_on:
        accumulate_instance_stats_and_numerics(x, acc, row, correction, numerics, numerics_row)
    else:
        accumulate_instance_stats(x, acc, row, correction)
    if amax is None:
        a = x.detach().abs().double()
        top = float(torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax()) if a.numel() else 0.0
    else:
        top = float(amax.reshape(-1)[0])
    fresh = block_numerics([x], codes, [top])[0].to(blocks.device)
    held = blocks[blocks_row].clone()
    merged = held + fresh
    for column, pick in (("min_nonzero", torch.minimum), ("max_block_ratio", torch.maximum)):
        k = BLOCK_COLUMNS.index(column)
        merged[:, k] = pick(held[:, k], fresh[:, k])
    blocks[blocks_row] = merged


def update_sums(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor],
                grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """[N, 5] float64 rows (UPDATE_COLUMNS) of what an optimizer step did: per parameter |a - b|^2, |b|^2,
    |g|^2, <a - b, g> (in float64) and the element count."""
    rows = []
    for b, a, g in zip(before, after, grads):
        b64, a64, g64 = b.detach().double(), a.detach().double(), g.detach().double()
        d = a64 - b64
        rows.append(torch.stack([(d * d).sum(), (b64 * b64).sum(), (g64 * g64).sum(), (d * g64).sum(),
                                 torch.tensor(float(b.numel()), dtype=torch.float64, device=b.device)]))
    return torch.stack(rows) if rows else torch.zeros(0, 5, dtype=torch.float64)


# ------------------------------------------------------------------ per-block formats (gapmon.stats.block_formats)
# Written from the specifications (OCP MX v1.0; NVIDIA's NVFP4; TransformerEngine's current scaling) in float64
# torch ops, independently of csrc/core/block_formats.h, which tests compare with this.
_ELEMENT = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0), "e2m1": (1, 0, 6.0)}  # mantissa bits, min normal exp, max
_BLOCK_FORMATS = (("mx", "e4m3", 32), ("mx", "e5m2", 32), ("mx", "e2m1", 32), ("nv", "e2m1", 16),
                  ("current", "e4m3", 32), ("current", "e5m2", 32))  # by format code


def cast_to_element(a: torch.Tensor, element: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, saturated): magnitudes a >= 0 (float64) rounded to nearest even on an element format's grid (its
    top binade's spacing continued upwards), saturated to its largest finite value where the rounded value
    is above it."""
    mantissa, min_exp, largest = _ELEMENT[element]
    exp = torch.frexp(a).exponent.to(torch.float64) - 1  # floor(log2 a), exact
    ulp = torch.exp2(torch.clamp(exp, min=min_exp) - mantissa)
    q = torch.round(a / ulp) * ulp  # torch.round: half to even
    saturated = q > largest
    q = torch.where(saturated, torch.full_like(q, largest), q)
    return torch.where(a == 0, torch.zeros_like(q), q), saturated


def _tensor_scale(numerator: float, amax: float) -> torch.Tensor:
    """A per-tensor float32 scale numerator / fp32(amax), as TransformerEngine computes it: 1 when amax is 0 or
    beyond float32, float32's largest value where the quotient overflows."""
    a32 = torch.tensor(amax, dtype=torch.float32)
    if not (amax > 0) or torch.isinf(a32):
        return torch.tensor(1.0)
    return (torch.tensor(numerator, dtype=torch.float32) / a32).clamp_max(torch.finfo(torch.float32).max)


def block_numerics(xs: Sequence[torch.Tensor], codes: Sequence[int], amaxes: Sequence[float]) -> torch.Tensor:
    """[N, F, 12] float64 rows (gapmon.stats.block_formats.BLOCK_COLUMNS) of xs cast to the block formats `codes`,
    blocks along the last dim; amaxes[i]: tensor i's largest finite |x| (for NVFP4 and current scaling)."""
    out = torch.zeros(len(xs), len(codes), 12, dtype=torch.float64)
    for i, x in enumerate(xs):
        wide = x.dtype == torch.float64
        x = x.detach().cpu().double()
        cols = x.shape[-1] if x.dim() else 1
        if x.numel() == 0:  # no blocks, no elements
            out[i, :, 9] = math.inf
            continue
        x = x.reshape(-1, cols)
        finite = torch.isfinite(x)
        a_all = torch.where(finite, x.abs(), torch.zeros_like(x))
        for f, code in enumerate(codes):
            kind, element, size = _BLOCK_FORMATS[code]
            mantissa, min_exp, largest = _ELEMENT[element]
            pad = (-cols) % size if cols else 0
            a = torch.nn.functional.pad(a_all, (0, pad)).reshape(x.shape[0], -1, size)
            fin = torch.nn.functional.pad(finite, (0, pad), value=True).reshape(x.shape[0], -1, size)
            amax_b = a.amax(-1, keepdim=True) if a.numel() else a.sum(-1, keepdim=True)
            under = over = torch.zeros_like(amax_b, dtype=torch.bool)
            if kind == "mx":
                top = {"e4m3": 8, "e5m2": 15, "e2m1": 2}[element]
                exp_b = torch.frexp(amax_b).exponent.to(torch.float64) - 1 - top
                exp_b = torch.where(amax_b > 0, exp_b, torch.full_like(exp_b, -127.0))
                under, over = exp_b < -127, exp_b > 127
                exp_b = exp_b.clamp(-127, 127)
                v = a * torch.exp2(-exp_b)
                q, saturated = cast_to_element(v, element)
                deq = q * torch.exp2(exp_b)
            elif kind == "nv":
                g = _tensor_scale(448.0 * 6.0, amaxes[i])
                scale_in = (amax_b.float() / 6.0) * g
                s, over = cast_to_element(scale_in.double(), "e4m3")
                under = (amax_b > 0) & (s < 2.0 ** -6)
                enc = torch.where(s > 0, g / s.float().clamp_min(torch.finfo(torch.float32).tiny), torch.zeros(()))
                enc = enc.clamp_max(torch.finfo(torch.float32).max)
                v = a * enc.double() if wide else (a.float() * enc).double()
                v = torch.where(s > 0, v, torch.zeros_like(v))
                q, saturated = cast_to_element(v, element)
                deq = q * s / g.double()
            else:
                scale = _tensor_scale(largest, amaxes[i])
                v = a * scale.double() if wide else (a.float() * scale).double()
                q, saturated = cast_to_element(v, element)
                deq = q / scale.double()
            nonzero = (a > 0) & fin
            ratio = torch.where(nonzero.any(-1), amax_b.squeeze(-1) / torch.where(nonzero, a, torch.full_like(a, math.inf)).amin(-1),
                                torch.zeros_like(amax_b.squeeze(-1))) if a.numel() else torch.zeros(1)
            out[i, f] = torch.tensor([
                nonzero.sum(), (nonzero & (q == 0)).sum(), (nonzero & (q > 0) & (q < 2.0 ** min_exp)).sum(),
                (nonzero & saturated).sum(), float(a.shape[0] * a.shape[1]), under.sum(), over.sum(),
                torch.where(fin, (a - deq) ** 2, torch.zeros_like(a)).sum(), (a_all ** 2).sum(),
                a_all[a_all > 0].min() if (a_all > 0).any() else math.inf, ratio.max() if ratio.numel() else 0.0,
                (~finite).sum()], dtype=torch.float64)
    return out


def per_sample_grad_norms(model: torch.nn.Module, loss_fn, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[B] float64 norms of exact per-sample gradients of the trainable parameters, materialised with
    torch.func.vmap(grad(...)) (loss_fn(model(x_i[None]), y_i[None]) per sample): the independent
    reference of gapmon.PerSampleGradNorms, for tests and benchmarks (it costs B gradients of memory)."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def loss_one(p, x, y):
        return loss_fn(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0))

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, inputs, targets)
    return torch.sqrt(sum(g.reshape(g.shape[0], -1).double().square().sum(1) for g in grads.values()))
