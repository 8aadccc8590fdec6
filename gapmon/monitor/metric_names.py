"""The names of GAPMonitor's metrics: built and parsed here only.

Per tensor or module: ``gap/{kind}/{name}/{field}``, kind one of KINDS, field one of FIELDS
(``max`` is the max |x|), or with GAPMonitor(numerics=...) one of NUMERICS_FIELDS:
``kurtosis`` and ``{format}_{share}`` (gapmon.numerics). Step-wide: ``gap/global_batch_size`` and
``gap/per_sample_grad_norm/{mean|max|min}``; with per-sample norms, the gradient noise scale of the
covered parameters, overall (group ``all``) and per layer type: ``gap/gns/{group}/{field}``, field one of
GNS_FIELDS; with GAPMonitor.watch_optimizer, ``gap/update/{parameter}/{field}``, field one of UPDATE_FIELDS.
"""
from __future__ import annotations

from typing import NamedTuple

from ..stats.block_formats import BLOCK_FORMATS, BLOCK_METRIC_FIELDS
from ..stats.numerics import FORMATS

PREFIX = "gap"
KINDS = ("params", "grads", "activations", "activation_grads")
FIELDS = ("max", "mean", "var", "norm", "nonfinite")
# The statistics column (gapmon.STAT_NAMES) behind each field of a parameter or gradient.
FIELD_COLUMNS = {"max": "max_abs", "mean": "mean", "var": "var", "norm": "norm", "nonfinite": "nonfinite"}
GLOBAL_BATCH_SIZE = f"{PREFIX}/global_batch_size"
# Of the update an optimizer applied to a parameter on a monitored step (GAPMonitor.watch_optimizer):
# |dw|, |dw|/|w|, RMS(dw), |dw|/lr, cos(dw, -grad), and the norms of Adam's moments where it has them.
UPDATE = "update"
UPDATE_FIELDS = ("norm", "ratio", "rms", "norm_per_lr", "cos_neg_grad", "exp_avg_norm", "exp_avg_sq_norm")
NUMERICS_SHARES = ("underflow", "overflow", "underflow_scaled")


def numerics_field(fmt: str, share: str) -> str:
    """``{format}_{share}``, e.g. ``bf16_underflow``."""
    return f"{fmt}_{share}"


NUMERICS_FIELDS = ("kurtosis", *(numerics_field(f, s) for f in FORMATS for s in NUMERICS_SHARES))
# GAPMonitor(block_formats=...): ``{format}_{field}`` per tensor and format, and the tensor's range_bits.
BLOCK_FORMAT_FIELDS = (*(f"{f}_{m}" for f in BLOCK_FORMATS for m in BLOCK_METRIC_FIELDS), "range_bits")


def numerics_histogram_name(group: str) -> str:
    """``gap/numerics/{kind}/{layer type}/log2_abs``: the histogram sinks' tag of the exponent
    histogram of one group of info["numerics_histograms"] (group "grads/Linear")."""
    return f"{PREFIX}/numerics/{group}/log2_abs"


class MetricName(NamedTuple):
    kind: str
    name: str
    field: str


def metric_name(kind: str, name: str, field: str) -> str:
    """``gap/{kind}/{name}/{field}``."""
    return f"{PREFIX}/{kind}/{name}/{field}"


def update_name(name: str, field: str) -> str:
    """``gap/update/{parameter}/{field}`` (field: one of UPDATE_FIELDS)."""
    return f"{PREFIX}/{UPDATE}/{name}/{field}"


def parse_update_name(key: str) -> tuple[str, str] | None:
    """(parameter, field) of an update metric's name, else None."""
    head, _, rest = key.partition("/")
    kind, _, rest = rest.partition("/")
    name, _, field = rest.rpartition("/")
    if head != PREFIX or kind != UPDATE or field not in UPDATE_FIELDS or not name:
        return None
    return name, field


def per_sample_norm_name(field: str) -> str:
    """``gap/per_sample_grad_norm/{field}`` (field: mean, max or min)."""
    return f"{PREFIX}/per_sample_grad_norm/{field}"


GNS_ALL = "all"  # the group of every covered parameter
# |G|^2 and tr(Sigma) estimated this step, their ratio, and B_simple from their moving averages.
GNS_FIELDS = ("grad_norm_sq", "noise_trace", "b_simple_step", "b_simple")


def gns_name(group: str, field: str) -> str:
    """``gap/gns/{group}/{field}`` (group: ``all`` or a layer type; field: one of GNS_FIELDS)."""
    return f"{PREFIX}/gns/{group}/{field}"


def parse_metric_name(key: str) -> MetricName | None:
    """(kind, name, field) of a per-tensor metric name, else None. Kind and field contain no "/",
    so every name round-trips, also one that contains "/" (a ModuleDict key may)."""
    head, _, rest = key.partition("/")
    kind, _, rest = rest.partition("/")
    name, _, field = rest.rpartition("/")
    if head != PREFIX or kind not in KINDS or (field not in FIELDS and field not in NUMERICS_FIELDS
                                                           and field not in BLOCK_FORMAT_FIELDS) or not name:
        return None
    return MetricName(kind, name, field)
