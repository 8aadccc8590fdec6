"""GAPMonitor's per-block format metrics (gapmon.stats.block_formats): what casting each parameter and
gradient to the named MX/NVFP4/current-scaled formats would do, emulated exactly, read from end_step's
one copy. The per-tensor scaled formats take each tensor's amax from the statistics the monitor takes
anyway."""
from __future__ import annotations

import warnings

import torch

from ..stats.block_formats import BLOCK_COLUMNS, block_metrics, block_numerics, finite_amaxes, range_bits
from .metric_names import metric_name
from .step_buffer import StepBuffer


class BlockFormatMetrics:
    """The metrics ``gap/{kind}/{name}/{format}_{field}`` and ``.../range_bits`` of the formats `formats`."""

    def __init__(self, formats: tuple[str, ...]):
        self.formats = formats
        self._names: list[tuple[str, str]] = []
        self._numels: list[int] = []
        self._amaxes: list[float] = []
        self._warned = False

    def on_device(self, names: list[tuple[str, str]], tensors: list[torch.Tensor], groups: list,
                  stat_rows: torch.Tensor, out: StepBuffer) -> None:
        """The block rows of the tensors (one read each, given their amaxes from `stat_rows`), added to `out`.
        FSDP1 flat pieces (`groups[i]` not None) are left out: a flat piece has lost the parameter's rows."""
        keep = [i for i, g in enumerate(groups) if g is None]
        if len(keep) < len(tensors) and not self._warned:
            self._warned = True
            warnings.warn("GAPMonitor: block_formats need each parameter's shape; FSDP1's flat parameters are left "
                          "out (use FSDP2 or use_orig_params=False-free DTensors)", RuntimeWarning, stacklevel=4)
        dense = [tensors[i].to_dense() if tensors[i].is_sparse else tensors[i] for i in keep]
        self._names = [names[i] for i in keep]
        self._numels = [t.numel() for t in dense]
        width = len(self.formats) * len(BLOCK_COLUMNS)
        if not dense:
            self._amaxes = []
            out.add("block_formats", torch.empty(0, dtype=torch.float64, device=out.device))
            return
        amaxes = finite_amaxes(dense, stat_rows[keep])
        self._amaxes = amaxes.tolist()
        rows = block_numerics(dense, self.formats, amaxes)
        out.add("block_formats", rows.reshape(len(dense) * width))

    def metrics(self, out: StepBuffer, host: list) -> dict[str, float]:
        flat = out.of(host, "block_formats")
        columns = len(BLOCK_COLUMNS)
        metrics: dict[str, float] = {}
        for i, (kind, name) in enumerate(self._names):
            base = i * len(self.formats) * columns
            for f, fmt in enumerate(self.formats):
                row = flat[base + f * columns: base + (f + 1) * columns]
                for field, value in block_metrics(row, self._numels[i]).items():
                    metrics[metric_name(kind, name, f"{fmt}_{field}")] = value
            metrics[metric_name(kind, name, "range_bits")] = range_bits(self._amaxes[i], flat[base: base + columns])
        return metrics
