"""Where GAPMonitor metrics go. Only rank 0 writes; every sink gets one call per monitored step."""
from __future__ import annotations

import errno
import json
import numbers
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from ..stats.numerics import log2_buckets
from ..utils import check_int
from .metric_names import numerics_histogram_name


@runtime_checkable
class Sink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float], info: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class JSONLSink:
    """One JSON object per step: {"step": S, "<metric>": value, ..., "nonfinite": {...}}.

    Each line reaches the file whole or not at all: a write that fails (a full disk) is cut back to
    the last whole line, kept, and written again before the next step's line (a warning says so,
    once per outage), so a disk that fills briefly loses nothing. Lines still unwritten at
    `close()`, or more than `max_pending` of them, raise OSError naming the file.

    NaN and Inf are written as the JSON extensions NaN/Infinity, which Python and pandas read back.
    """

    def __init__(self, path: str | Path, max_pending: int = 10_000):
        self.path = Path(path)
        self.max_pending = check_int(max_pending, "gapmon.JSONLSink", "max_pending (steps kept in memory while the file "
                                     "cannot be written)")
        self._fd: int | None = None
        self._pending: list[bytes] = []  # whole lines not yet in the file, oldest first
        self._outage = False  # a write failed and none has succeeded since

    def write(self, step: int, metrics: Mapping[str, float], info: Mapping[str, Any]) -> None:
        record = {"step": int(step) if isinstance(step, numbers.Integral) else step, **metrics, **info}
        self._pending.append((json.dumps(record) + "\n").encode("utf-8"))
        self._drain()
        if len(self._pending) > self.max_pending:
            raise OSError(errno.ENOSPC, f"gapmon.JSONLSink: {len(self._pending)} steps' metrics could not be written "
                                        f"to {self.path} (kept in memory so far); free space there", str(self.path))

    def _open(self) -> int:
        if self._fd is not None and os.fstat(self._fd).st_nlink == 0:
            # The file was deleted while open: writing on would go nowhere. Start a new one.
            warnings.warn(f"gapmon: {self.path} was deleted during the run; metrics continue in a new file there",
                          RuntimeWarning, stacklevel=3)
            os.close(self._fd)
            self._fd = None
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        return self._fd

    def _drain(self) -> None:
        """Writes the pending lines in order, each whole or not at all."""
        try:
            fd = self._open()
        except OSError as e:
            self._failed(e)
            return
        while self._pending:
            line = self._pending[0]
            end = os.fstat(fd).st_size
            try:
                written = os.write(fd, line)
                if written != len(line):  # a short write: the disk filled in the middle of the line
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as e:
                try:
                    os.ftruncate(fd, end)  # no partial line stays behind
                except OSError:
                    pass
                self._failed(e)
                return
            self._pending.pop(0)
            if self._outage:
                warnings.warn(f"gapmon: {self.path} is writable again; the metrics held back were written",
                              RuntimeWarning, stacklevel=3)
                self._outage = False

    def _failed(self, error: OSError) -> None:
        if not self._outage:
            warnings.warn(f"gapmon: cannot write metrics to {self.path} ({error.strerror or error}); "
                          f"the lines are kept and written once it is writable again", RuntimeWarning, stacklevel=4)
            self._outage = True

    def close(self) -> None:
        """Writes what is pending and closes the file; raises OSError if lines remain unwritten."""
        if self._pending:
            self._drain()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._pending:
            lost, self._pending = len(self._pending), []
            raise OSError(errno.ENOSPC, f"gapmon.JSONLSink: the metrics of {lost} step(s) could not be written to "
                                        f"{self.path}", str(self.path))


class TensorBoardSink:
    """Scalars to TensorBoard (needs the `tensorboard` package)."""

    def __init__(self, log_dir: str | Path, **writer_kwargs):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("gapmon.TensorBoardSink needs tensorboard: pip install tensorboard") from e
        self._writer_cls = SummaryWriter
        self._args = (str(log_dir),)
        self._kwargs = writer_kwargs
        self._writer = None

    def write(self, step: int, metrics: Mapping[str, float], info: Mapping[str, Any]) -> None:
        if self._writer is None:
            self._writer = self._writer_cls(*self._args, **self._kwargs)
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)
        for key, bins in info.get("numerics_histograms", {}).items():
            edges, counts = log2_buckets(bins)
            if edges:  # a histogram of log2|x| (finite non-zero values), bucket limits are upper edges
                mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
                self._writer.add_histogram_raw(
                    numerics_histogram_name(key), min=edges[0], max=edges[-1], num=sum(counts),
                    sum=sum(m * c for m, c in zip(mids, counts)), sum_squares=sum(m * m * c for m, c in zip(mids, counts)),
                    bucket_limits=edges[1:], bucket_counts=counts, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink:
    """Metrics to Weights & Biases (needs the `wandb` package); `wandb.init(**init_kwargs)` on first write
    unless a run is already active."""

    def __init__(self, **init_kwargs):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("gapmon.WandbSink needs wandb: pip install wandb") from e
        self._wandb = wandb
        self._init_kwargs = init_kwargs
        self._own_run = False

    def write(self, step: int, metrics: Mapping[str, float], info: Mapping[str, Any]) -> None:
        if self._wandb.run is None:
            self._wandb.init(**self._init_kwargs)
            self._own_run = True
        logged: dict[str, Any] = dict(metrics)
        for key, bins in info.get("numerics_histograms", {}).items():
            edges, counts = log2_buckets(bins)
            if edges:
                logged[numerics_histogram_name(key)] = self._wandb.Histogram(np_histogram=(counts, edges))
        self._wandb.log(logged, step=step)

    def close(self) -> None:
        if self._own_run and self._wandb.run is not None:
            self._wandb.finish()
        self._own_run = False


class CallableSink:
    """Wraps fn(step, metrics) as a sink."""

    def __init__(self, fn: Callable[[int, Mapping[str, float]], Any]):
        self.fn = fn

    def write(self, step: int, metrics: Mapping[str, float], info: Mapping[str, Any]) -> None:
        self.fn(step, metrics)

    def close(self) -> None:
        pass


def as_sink(obj) -> Sink:
    """A Sink from a sink object or a callable; TypeError for anything else."""
    if isinstance(obj, Sink):
        return obj
    if callable(obj):
        return CallableSink(obj)
    raise TypeError(
        f"gapmon: a sink must have write(step, metrics, info) and close(), or be a callable fn(step, metrics); "
        f"got {type(obj).__name__}"
    )
