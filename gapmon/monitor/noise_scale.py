"""The gradient noise scale (McCandlish et al. 2018) from per-sample gradient norms, exact across ranks and
micro-batches: the critical batch size B_simple = tr(Sigma) / |G|^2 of the covered parameters.

A step's gradient is g = sum_i w_i g_i over the samples of the global batch, g_i the gradient of sample i's own
loss and w_i its weight in the loss (PerSampleGradNorms.loss_weights, divided by the number of data-parallel
ranks that average the gradient). With S_i = |g_i|^2, W1 = sum_i w_i and W2 = sum_i w_i^2, for independent
samples E|g|^2 = W1^2 |G|^2 + W2 tr(Sigma) and E[mean_i S_i] = |G|^2 + tr(Sigma), so the unbiased estimates are

    |G|^2    = (|g|^2 - W2 mean S) / (W1^2 - W2)        tr(Sigma) = mean S - |G|^2

(with w_i = 1/B: |G|^2 = (B |g|^2 - mean S) / (B - 1), tr(Sigma) = B (mean S - |g|^2) / (B - 1)). B_simple is
the ratio of the two estimates' exponential moving averages (not the average of the per-step ratios).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..per_sample.sample_ids import all_gather_rows
from ..utils import rank_and_world
from .metric_names import gns_name
from .step_buffer import StepBuffer


def two_batch_estimates(small_sq: float, big_sq: float, b_small: float, b_big: float) -> tuple[float, float] | None:
    """(|G|^2, tr(Sigma)) from the squared norms of mean gradients over b_small and b_big samples (McCandlish
    et al., appendix A): |G|^2 = (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small),
    tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1/b_small - 1/b_big); None when b_big <= b_small."""
    if not 0 < b_small < b_big or not math.isfinite(small_sq) or not math.isfinite(big_sq):
        return None
    return (b_big * big_sq - b_small * small_sq) / (b_big - b_small), (small_sq - big_sq) / (1 / b_small - 1 / b_big)


def noise_estimates(batch_grad_sq: float, mean_sample_sq: float, w1: float, w2: float) -> tuple[float, float] | None:
    """(|G|^2, tr(Sigma)) estimated from one step, or None when the step cannot tell them apart (one sample)."""
    denominator = w1 * w1 - w2
    if not denominator > 0 or not math.isfinite(batch_grad_sq) or not math.isfinite(mean_sample_sq):
        return None
    grad_sq = (batch_grad_sq - w2 * mean_sample_sq) / denominator
    return grad_sq, mean_sample_sq - grad_sq


class NoiseScale:
    """Per group (every covered parameter, and each layer type), the moving averages (decay `decay`) of the
    estimates of |G|^2 and tr(Sigma), and the metrics of a step."""

    def __init__(self, decay: float):
        self.decay = decay
        self._averages: dict[str, tuple[float, float]] = {}

    @staticmethod
    def on_device(buffer: StepBuffer, squared: dict[str, torch.Tensor], weights: torch.Tensor, averaged_over: int) -> None:
        """Adds this rank's sums to `buffer` (reduced over ranks with the other sums): per group the sum of
        the squared per-sample norms, then the sample count, sum w_i and sum w_i^2 (w_i / averaged_over: the
        weight of sample i in the data-parallel mean of the ranks' gradients)."""
        device = buffer.device
        w = weights.to(device, torch.float64) / averaged_over
        sums = [squared[group].to(device, torch.float64).sum() for group in sorted(squared)]
        count = torch.tensor(float(w.numel()), dtype=torch.float64, device=device)
        buffer.add("gns", torch.stack([*sums, count, w.sum(), (w * w).sum()]))

    @staticmethod
    def on_device_by_id(buffer: StepBuffer, squared: dict[str, torch.Tensor], weights: torch.Tensor,
                        averaged_over: float, ids: torch.Tensor, group: Any, refusal: str = "") -> None:
        """on_device for samples that several ranks may hold (the same id): every rank's ids, squared norms
        and weights are all-gathered, each sample counts once with the sum of its weights (a sample two ranks
        average holds weight w/2 on each), and rank 0 adds the sums (the monitor's reduction adds them). A rank
        whose ids do not count its samples, or that brings a `refusal` (its ids were refused), makes every rank
        raise (in the gather: none is left waiting)."""
        device = buffer.device
        groups = sorted(squared)
        values = torch.stack([squared[g].to(torch.float64).cpu() for g in groups]
                             + [weights.to(torch.float64).cpu() / averaged_over], dim=1)
        if not refusal and ids.numel() != values.shape[0]:
            refusal = (f"GAPMonitor: got {ids.numel()} sample ids for the step's {values.shape[0]} samples (pass "
                       "every micro-batch's ids, in order)")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            ids, values = all_gather_rows(ids, values, group, refusal)
        elif refusal:
            raise ValueError(refusal)
        unique, inverse = torch.unique(ids, return_inverse=True)
        n = unique.numel()
        w = torch.zeros(n, dtype=torch.float64).index_add_(0, inverse, values[:, -1])
        copies = torch.zeros(n, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(values[:, -1]))
        sq = torch.zeros(n, len(groups), dtype=torch.float64).index_add_(0, inverse, values[:, :-1]) / copies[:, None]
        high = torch.full_like(sq, -math.inf).scatter_reduce_(0, inverse[:, None].expand_as(values[:, :-1]),
                                                               values[:, :-1], "amax")
        if bool((high - sq > 1e-6 * sq.abs() + 1e-300).any()):  # the mean of a sample's copies is below their max
            raise ValueError("GAPMonitor: samples with the same id have different per-sample gradient norms on "
                             "different ranks: give each sample its own id (the same id must mean the same sample)")
        sums = torch.cat([sq.sum(0), torch.tensor([float(n)], dtype=torch.float64), w.sum().reshape(1),
                          (w * w).sum().reshape(1)])
        if rank_and_world(group)[0] != 0:
            sums = torch.zeros_like(sums)
        buffer.add("gns", sums.to(device))

    def add(self, group: str, estimates: tuple[float, float] | None) -> dict[str, float]:
        """The metrics of one group's estimates (|G|^2, tr Sigma) of this step, its moving averages updated."""
        if estimates is None:
            return {}
        grad_sq, trace = estimates
        previous = self._averages.get(group)
        averaged = (grad_sq, trace) if previous is None else tuple(
            self.decay * old + (1 - self.decay) * new for old, new in zip(previous, (grad_sq, trace)))
        self._averages[group] = averaged
        return {gns_name(group, "grad_norm_sq"): grad_sq, gns_name(group, "noise_trace"): trace,
                gns_name(group, "b_simple_step"): trace / grad_sq if grad_sq != 0 else math.nan,
                gns_name(group, "b_simple"): averaged[1] / averaged[0] if averaged[0] != 0 else math.nan}

    def metrics(self, groups: list[str], sums: list[float], batch_grad_sq: dict[str, float]) -> dict[str, float]:
        """The step's metrics from the reduced sums (groups sorted as on_device added them) and the squared
        norm of the step's gradient over each group's parameters."""
        *sample_sq, count, w1, w2 = sums
        metrics: dict[str, float] = {}
        if count < 2:
            return metrics
        for group, total in zip(groups, sample_sq):
            metrics.update(self.add(group, noise_estimates(batch_grad_sq.get(group, 0.0), total / count, w1, w2)))
        return metrics
