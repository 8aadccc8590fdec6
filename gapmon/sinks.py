"""Where GAPMonitor metrics go. Only rank 0 writes; every sink gets one call per monitored step."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, runtime_checkable


@runtime_checkable
class Sink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float], info: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class JSONLSink:
    """One JSON object per step, flushed at once: {"step": S, "<metric>": value, ..., "nonfinite": {...}}.

    NaN and Inf are written as the JSON extensions NaN/Infinity, which Python and pandas read back.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = None

    def write(self, step: int, metrics: Mapping[str, float], info: Mapping[str, Any]) -> None:
        if self._file is not None and os.fstat(self._file.fileno()).st_nlink == 0:
            # The file was deleted while open: writing on would go nowhere. Start a new one.
            warnings.warn(f"gapmon: {self.path} was deleted during the run; metrics continue in a new file there",
                          RuntimeWarning, stacklevel=2)
            self._file.close()
            self._file = None
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        record = {"step": step, **metrics, **info}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
        self._wandb.log(dict(metrics), step=step)

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
