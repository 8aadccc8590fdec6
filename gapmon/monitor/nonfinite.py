"""Where non-finite values first appeared in a step: the first module (in forward, then backward order)
and the tensors whose metrics say NaN or Inf."""
from __future__ import annotations

import logging
import math
from typing import Any

from ..utils import rank_and_world
from .metric_names import parse_metric_name

logger = logging.getLogger("gapmon")


def localise_nonfinite(metrics: dict[str, float], module_names: list[str], first_seen: list[list[int]],
                       step: int) -> dict[str, Any]:
    """{"first_activation": module, "activations": [...], "grads": [...], ...} naming the modules and
    tensors with non-finite values, {} when there are none; logs a warning on rank 0."""
    # Fast path, every healthy step: a NaN or Inf element makes its mean or max non-finite, so
    # all-finite metrics mean nothing to localise (and no metric name needs parsing).
    # One sum in C checks them all: it is finite only if every metric is (a sum that overflows
    # takes the exact path below, which then finds nothing).
    if math.isfinite(sum(metrics.values())):
        return {}
    bad: dict[str, list[str]] = {}
    for key, value in metrics.items():
        parsed = parse_metric_name(key)
        if parsed is None:
            continue
        kind, name, field = parsed
        if (field == "nonfinite" and value > 0) or (field in ("mean", "max") and not math.isfinite(value)):
            if name not in bad.setdefault(kind, []):
                bad[kind].append(name)
    if not bad:
        return {}
    report: dict[str, Any] = {}
    module_index = {name: i for i, name in enumerate(module_names)}
    for kind, order_index in (("activations", 0), ("activation_grads", 1)):
        if kind in bad:
            seen = first_seen[order_index]
            ordered = sorted(bad[kind], key=lambda n: seen[module_index[n]] if seen[module_index[n]] >= 0 else 1 << 30)
            report[f"first_{kind[:-1]}"] = ordered[0]
            report[kind] = ordered
    for kind in ("params", "grads"):
        if kind in bad:
            report[kind] = bad[kind]
    if rank_and_world()[0] == 0:
        first = report.get("first_activation") or report.get("first_activation_grad")
        where = f"first in module '{first}'" if first else f"in {', '.join(report.get('grads', report.get('params', [])))}"
        logger.warning("gapmon: non-finite values at step %s: %s", step, where)
    return report
