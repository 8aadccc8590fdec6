"""GAPMonitor's per-block format metrics (gapmon.stats.block_formats): what casting each parameter,
gradient, activation and activation gradient to the named MX/NVFP4/current-scaled formats would do,
emulated exactly, read from end_step's one copy. The per-tensor scaled formats take each parameter's and
gradient's amax from the statistics the monitor takes anyway; each activation is cast with its own scales
in its hook (ActivationRecorder), its rows merged over micro-batches and, here, over the ranks."""
from __future__ import annotations

import warnings

import torch

from ..stats.block_formats import BLOCK_COLUMNS, block_metrics, block_numerics, finite_amaxes, range_bits
from ..stats.layout import STAT_NAMES
from .activations import ACTIVATION_KINDS, ActivationRecorder
from .metric_names import metric_name
from .step_buffer import StepBuffer

_MIN, _MAX = BLOCK_COLUMNS.index("min_nonzero"), BLOCK_COLUMNS.index("max_block_ratio")
_MAX_ABS, _NONFINITE = STAT_NAMES.index("max_abs"), STAT_NAMES.index("nonfinite")
_SUMS = [i for i in range(len(BLOCK_COLUMNS)) if i not in (_MIN, _MAX)]


class BlockFormatMetrics:
    """The metrics ``gap/{kind}/{name}/{format}_{field}`` and ``.../range_bits`` of the formats `formats`."""

    def __init__(self, formats: tuple[str, ...], recorder: ActivationRecorder):
        self.formats, self.recorder = formats, recorder
        self._names: list[tuple[str, str]] = []
        self._numels: list[int] = []
        self._amaxes: list[float] | None = []  # None: taken from the step's host copy of the statistics rows
        self._kept: list[int] = []
        self._dense: list[torch.Tensor] = []
        self._warned = False

    def tensors_on_device(self, names: list[tuple[str, str]], tensors: list[torch.Tensor], groups: list,
                          stat_rows: torch.Tensor, out: StepBuffer, block_rows: torch.Tensor | None = None) -> None:
        """The block rows of the tensors added to `out`: `block_rows` when the statistics pass took them, else
        cast here (one more read each, given their amaxes from `stat_rows`). FSDP1 flat pieces (`groups[i]` not
        None) are left out: a flat piece has lost the parameter's rows."""
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
        if block_rows is None:
            amaxes = finite_amaxes(dense, stat_rows[keep])
            self._amaxes = amaxes.tolist()
            rows = block_numerics(dense, self.formats, amaxes)
        else:  # the amaxes (for range_bits) wait for the step's one host copy: no read to the host here
            self._amaxes, self._kept, self._dense = None, keep, dense
            rows = block_rows[keep]
        out.add("block_formats", rows.reshape(len(dense) * width))

    def _amaxes_from(self, out: StepBuffer, host: list) -> list[float]:
        """Each kept tensor's largest finite |x|: its statistics row's max_abs from the host copy, measured only
        for a tensor with non-finite elements (whose max_abs is not finite)."""
        rows, width = out.of(host, "rows"), len(STAT_NAMES)
        amaxes = []
        for i, j in enumerate(self._kept):
            row = rows[j * width:(j + 1) * width]
            amaxes.append(row[_MAX_ABS] if row[_NONFINITE] == 0 else finite_amaxes([self._dense[i]])[0].item())
        self._dense = []
        return amaxes

    # The activations' rows: a contributor to the monitor's reduction over the ranks (readout.reduced_step).
    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = self.recorder.blocks
        if blocks.table is None:
            blocks.reset(device)
        return blocks.table.to(device), blocks.numels.to(device)

    def on_device(self, sums: StepBuffer, maxes: StepBuffer) -> None:
        table, numels = self._table(sums.device)
        sums.add("block_act", torch.cat((table[..., _SUMS].reshape(-1), numels)))
        maxes.add("block_act", torch.stack((-table[..., _MIN], table[..., _MAX]), dim=-1).reshape(-1))

    def to_copy(self, out: StepBuffer, sums: StepBuffer, sums_t: torch.Tensor, maxes: StepBuffer,
                maxes_t: torch.Tensor) -> None:
        out.add("block_act_sums", sums.of(sums_t, "block_act"))
        out.add("block_act_maxes", maxes.of(maxes_t, "block_act"))

    def _activation_metrics(self, out: StepBuffer, host: list) -> dict[str, float]:
        rows, f = self.recorder.blocks.rows, len(self.formats)
        sums, maxes = out.of(host, "block_act_sums"), out.of(host, "block_act_maxes")
        per_row = f * len(_SUMS)
        numels = sums[rows * per_row:]
        metrics: dict[str, float] = {}
        m = len(self.recorder.modules)
        for r in range(rows):
            kind = ACTIVATION_KINDS[r // m]
            if not self.recorder.kinds[r // m] or numels[r] == 0:
                continue
            name = self.recorder.modules[r % m][0]
            for j, fmt in enumerate(self.formats):
                row = [0.0] * len(BLOCK_COLUMNS)
                base = r * per_row + j * len(_SUMS)
                for k, column in enumerate(_SUMS):
                    row[column] = sums[base + k]
                row[_MIN], row[_MAX] = -maxes[2 * (r * f + j)], maxes[2 * (r * f + j) + 1]
                for field, value in block_metrics(row, int(numels[r])).items():
                    metrics[metric_name(kind, name, f"{fmt}_{field}")] = value
        return metrics

    def metrics(self, out: StepBuffer, host: list) -> dict[str, float]:
        flat = out.of(host, "block_formats")
        columns = len(BLOCK_COLUMNS)
        metrics: dict[str, float] = self._activation_metrics(out, host)
        if self._amaxes is None:
            self._amaxes = self._amaxes_from(out, host)
        for i, (kind, name) in enumerate(self._names):
            base = i * len(self.formats) * columns
            for f, fmt in enumerate(self.formats):
                row = flat[base + f * columns: base + (f + 1) * columns]
                for field, value in block_metrics(row, self._numels[i]).items():
                    metrics[metric_name(kind, name, f"{fmt}_{field}")] = value
            metrics[metric_name(kind, name, "range_bits")] = range_bits(self._amaxes[i], flat[base: base + columns])
        return metrics
