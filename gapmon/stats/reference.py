"""Pure-PyTorch statistics: the slow, obviously-correct way.

This module is the fallback backend when the compiled extension is missing and the baseline
that tests and benchmarks compare the fused kernels against. Each statistic is a separate
torch op (one or more passes over memory each); half-precision inputs are upcast to float32.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch

from .layout import ACC_NAMES, BIN, EXP_MAX, EXP_MIN, NUM_BINS, NUMERICS_COLUMNS, STAT_NAMES, Stats, check_tensor


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
    norm = torch.linalg.vector_norm(xf, dim=1)
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
