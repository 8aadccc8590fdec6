"""GAPMonitor's numerics: per tensor, kurtosis and the shares of each format's under/overflow; per kind
and layer type, exponent histograms and the elements that under/overflow at their tensor's own
power-of-two scale; alerts above a share. Computed on the device and read from end_step's one copy."""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..stats.layout import NUM_BINS, NUMERICS_COLUMNS
from ..stats.numerics import merge_numerics_states, numerics_from_rows, numerics_states, sparse_histogram
from .activations import ACTIVATION_KINDS, ActivationRecorder
from .metric_names import NUMERICS_SHARES, metric_name, numerics_field
from .step_buffer import MetricPickers, StepBuffer


class NumericsMetrics:
    """Numerics of the formats `formats` for the rows GAPMonitor collects. `layer_type(kind, name)` names
    the histogram group of a row ("Linear"); `group` is the process group the activations merge over."""

    def __init__(self, formats: tuple[str, ...], alert: float | None, layer_type: Callable[[str, str], str],
                 recorder: ActivationRecorder, group: Any):
        self.formats, self.alert, self.layer_type = formats, alert, layer_type
        self.recorder, self.group = recorder, group
        self._cache = MetricPickers(())

    def on_device(self, names: list[tuple[str, str]], tensors: list[torch.Tensor], groups: list, out: StepBuffer,
                  rows: torch.Tensor | None) -> tuple[list, list[str], list[str]]:
        """Kurtosis and per-format shares of the parameters and gradients (`rows`, taken in the
        statistics' pass; else one more pass over them) and of the monitored activations and
        activation gradients (a pass in their hooks), and exponent histograms per kind and layer type,
        added to `out` for end_step's one copy. Returns what `add` needs to read them: (row names,
        field names, histogram groups)."""
        if rows is None:  # sparse gradients: numerics of their dense form
            dense = [t.to_dense() if t.is_sparse else t for t in tensors]
            rows = numerics_states(dense, groups)  # FSDP1 flat shards: pieces merged over their groups
        act_names, act_rows = self._activation_rows(out.device)  # where the collectives run (NCCL: the GPU)
        names, rows = [*names, *act_names], torch.cat([rows.to(out.device), act_rows])
        result = numerics_from_rows(rows, self.formats)
        columns = [("kurtosis", result.kurtosis)]
        columns += [(numerics_field(f, s), result.shares[f][s]) for f in self.formats for s in NUMERICS_SHARES]
        keys, index = self._histogram_groups(tuple(names), rows.device)
        hists = torch.zeros(len(keys), NUM_BINS, dtype=torch.float64, device=rows.device).index_add_(
            0, index, rows[:, :NUM_BINS])  # exact counts
        # Per group and format, the elements that under/overflow at each tensor's own power-of-two scale
        # (what a scaled recipe sees): share x count per tensor, summed exactly (integers in float64).
        count = rows[:, NUM_BINS]
        scaled = [torch.nan_to_num(result.shares[f][s]) * count for f in self.formats
                  for s in ("underflow_scaled", "overflow_scaled")]
        scaled_counts = torch.zeros(len(keys), 2 * len(self.formats), dtype=torch.float64, device=rows.device)
        if names:
            scaled_counts.index_add_(0, index, torch.stack(scaled, dim=1).round())
        out.add("numerics", torch.stack([c for _, c in columns], dim=1) if names else rows.new_empty(0))
        out.add("histograms", hists)
        out.add("scaled_counts", scaled_counts)
        return names, [field for field, _ in columns], keys

    def add(self, metrics: dict[str, float], info: dict[str, Any], numerics, out: StepBuffer, host: list,
            step: int) -> None:
        """The numerics metrics, histograms and alerts from end_step's host copy."""
        names, fields, keys = numerics
        table, counts, scaled = out.of(host, "numerics"), out.of(host, "histograms"), out.of(host, "scaled_counts")
        # Groups that hold no element this step (containers whose output is a child's, read once) are left out.
        held = [(i, k) for i, k in enumerate(keys) if any(counts[i * NUM_BINS:(i + 1) * NUM_BINS])]
        info["numerics_histograms"] = {k: sparse_histogram(counts[i * NUM_BINS:(i + 1) * NUM_BINS]) for i, k in held}
        width = 2 * len(self.formats)
        info["numerics_scaled"] = {k: {f: {"underflow": int(scaled[i * width + 2 * j]), "overflow": int(scaled[i * width + 2 * j + 1])}
                                       for j, f in enumerate(self.formats)} for i, k in held}
        alerts = []
        for i, (kind, name) in enumerate(names):
            row = table[i * len(fields):(i + 1) * len(fields)]
            # Modules that ran on no rank this step have empty activation rows: no metrics (as their statistics).
            if kind.startswith("activation") and all(math.isnan(v) for v in row):
                continue
            for field, value in zip(fields, row):
                if not math.isnan(value):
                    metrics[metric_name(kind, name, field)] = value
                    if (self.alert is not None and field.endswith(("_underflow", "_overflow"))
                            and value > self.alert):
                        alerts.append(f"{kind}/{name}: {field} {value:.3g}")
        if alerts:
            info["numerics_alerts"] = alerts
            warnings.warn(f"GAPMonitor step {step}: {len(alerts)} share(s) above numerics_alert={self.alert}: "
                          f"{alerts[:8]}{' ...' if len(alerts) > 8 else ''}", RuntimeWarning, stacklevel=4)

    def _histogram_groups(self, names: tuple[tuple[str, str], ...], device: torch.device) -> tuple[list[str], torch.Tensor]:
        """The histogram groups ("grads/Linear", ...) of numerics rows `names`, sorted, and the group of
        each row as an index tensor on `device`: built once per set of rows (not every step)."""
        def build():
            groups_of = [f"{kind}/{self.layer_type(kind, name)}" for kind, name in names]
            keys = sorted(set(groups_of))
            return keys, torch.tensor([keys.index(g) for g in groups_of], dtype=torch.long, device=device)

        return self._cache.cached("histogram_groups", (names, device), build)

    def _activation_rows(self, device: torch.device) -> tuple[list[tuple[str, str]], torch.Tensor]:
        """(kind, module) names and numerics rows of the monitored activations and activation gradients,
        each merged over its micro-batches and over the ranks of the process group (all-gathered and
        merged in rank order: exact, as the shards of a tensor). Rows of modules that did not run are
        empty (count 0)."""
        recorder = self.recorder
        kinds = [k for k, on in enumerate(recorder.kinds) if on]
        m = len(recorder.modules)
        if not kinds or not m:
            return [], torch.empty(0, len(NUMERICS_COLUMNS), dtype=torch.float64, device=device)
        table = (recorder.num_acc.to(device) if recorder.num_acc is not None
                 else torch.zeros(2 * m, len(NUMERICS_COLUMNS), dtype=torch.float64, device=device))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            parts = [torch.empty_like(table) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, table, group=self.group)
            table = merge_numerics_states(torch.stack(parts))
        picked = [kind * m + i for kind in kinds for i in range(m)]
        return [(ACTIVATION_KINDS[r // m], recorder.modules[r % m][0]) for r in picked], table[picked]
