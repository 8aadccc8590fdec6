"""A drop-in gapmon replacement for OLMo-core's `GAPMonitorCallback`.

    from gapmon.integrations.olmo import GAPMonitorCallback
    trainer_config.with_callback("gap_monitor", GAPMonitorCallback(interval=10, dump_gradients=True))

Same configuration fields as OLMo-core's callback (`enabled`, `monitor`, `interval`, the
`dump_gradients*` fields) and the same metric names (`gap/{params|grads|activations|
activation_grads}/{name}/{max|mean|var}`, plus `norm` and `nonfinite`), computed by GAPMonitor:
fused one-pass kernels, one collective per reduce kind, hooks that never change the gradients
they watch, activation checkpointing counted once. Metrics are recorded through the trainer's own
`record_metric`; gradient dumps are written by GradientDumper under the run's save folder
(`<save_folder>/gradients`, or the trainer's work_dir when the save folder is remote) — sampled
mode when `dump_gradients_save_first_n` is set, else a distributed checkpoint (mode "full"), unless
`dump_gradients_mode` says otherwise.

gapmon's own options (which kinds to measure, per-sample norms, numerics, sinks, ...) are one field,
`gapmon_config` (a gapmon.MonitorConfig; its schedule comes from `interval`); the dumper's
(`dump_gradients_*`) map onto a gapmon.DumpConfig. `monitor_config()` and `dump_config()` show what
the callback builds.

Per-sample gradient norms are those of each sample's own loss (the mean cross entropy of its label
tokens), whatever the train module's scaling: it sums the cross entropy of every micro-batch's tokens
and divides by the rank's number of label tokens over the whole step (`loss_div_factor`), which the
callback reads from each micro-batch's forward call. A sample with no label tokens has norm 0.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from . import require, tokens_per_sample, unwrap_optimizer, watch_micro_batches

require("olmo_core", "olmo", "ai2-olmo-core")

from olmo_core.train.callbacks.callback import Callback  # noqa: E402

from ..config import DumpConfig, MonitorConfig, Schedule  # noqa: E402
from ..dump.dumper import GradientDumper  # noqa: E402
from ..monitor.gap_monitor import GAPMonitor  # noqa: E402


@dataclass
class GAPMonitorCallback(Callback):
    """Gradient, activation and parameter monitoring (and gradient dumps) for OLMo-core's Trainer."""

    enabled: bool = True
    monitor: Optional[bool] = None
    interval: int = 1
    dump_gradients: Optional[bool] = None
    dump_gradients_start_step: int = 0
    dump_gradients_end_step: Optional[int] = None
    dump_gradients_step_interval: int = 1
    dump_gradients_save_first_n: Optional[int] = None
    # gapmon's own options: the dumper's mode (None: OLMo's rule above), its writes, and the monitor's.
    dump_gradients_mode: Optional[str] = None
    dump_gradients_async_write: bool = True
    dump_gradients_timeout: float = 600.0
    gapmon_config: MonitorConfig = dataclasses.field(default_factory=MonitorConfig)
    optimizer_stats: bool = False  # also the update of the train module's optimizer (gap/update/...)

    _monitor: Optional[GAPMonitor] = dataclasses.field(default=None, repr=False)
    _dumper: Optional[GradientDumper] = dataclasses.field(default=None, repr=False)
    _in_step: bool = dataclasses.field(default=False, repr=False)
    _watch: Any = dataclasses.field(default=None, repr=False)
    _logged_update: Any = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if not self.enabled and (self.monitor or self.dump_gradients):
            raise ValueError("GAPMonitorCallback: monitor or dump_gradients is True but enabled=False; "
                             "set enabled=True to use them")
        if self.enabled:
            self.monitor = True if self.monitor is None else self.monitor
            self.dump_gradients = False if self.dump_gradients is None else self.dump_gradients
            if not self.monitor and not self.dump_gradients:
                raise ValueError("GAPMonitorCallback: enabled=True but monitor and dump_gradients are both False")
        if self.enabled and self.monitor:
            self.monitor_config()  # validated now, not when training starts
        if self.enabled and self.dump_gradients:
            self.dump_config()

    def monitor_config(self) -> MonitorConfig:
        """gapmon_config with the schedule of `interval` (or gapmon_config's own, when interval is left at 1)."""
        config = self.gapmon_config
        if not isinstance(config, MonitorConfig):
            raise TypeError(f"GAPMonitorCallback: gapmon_config must be a gapmon.MonitorConfig, got {config!r}")
        if self.interval != 1:
            if config.schedule != Schedule():
                raise ValueError("GAPMonitorCallback: give the monitor's schedule either as interval or as "
                                 "gapmon_config.schedule, not both")
            config = dataclasses.replace(config, schedule=Schedule(every=self.interval))
        return config

    def dump_config(self) -> DumpConfig:
        """The dump_gradients_* fields as a gapmon.DumpConfig."""
        mode = self.dump_gradients_mode
        if mode is None:
            mode = "sampled" if self.dump_gradients_save_first_n is not None else "full"
        schedule = Schedule(every=self.dump_gradients_step_interval, start=self.dump_gradients_start_step,
                            end=self.dump_gradients_end_step)
        return DumpConfig(schedule=schedule, mode=mode, save_first_n=self.dump_gradients_save_first_n,
                          async_write=self.dump_gradients_async_write, timeout=self.dump_gradients_timeout)

    @property
    def model(self) -> Any:
        return self.trainer.train_module.model

    def _dump_dir(self) -> Path:
        folder = str(self.trainer.save_folder)
        return (Path(self.trainer.work_dir) if "://" in folder else Path(folder)) / "gradients"

    def pre_train(self):
        if not self.enabled:
            return
        if self.monitor:
            self._monitor = GAPMonitor.from_config(self.model, self.monitor_config())
            # pre_step counts the rank's samples from the whole batch; the hook declares the loss scaling.
            self._watch = watch_micro_batches(self.model, self._monitor, _loss_weights, count_samples=False)
            if self.optimizer_stats:
                self._monitor.watch_optimizer(unwrap_optimizer(self.trainer.train_module.optim))
        if self.dump_gradients:
            self._dumper = GradientDumper.from_config(self.model, self._dump_dir(), self.dump_config())

    def pre_step(self, batch: dict[str, Any]):
        if self._monitor is not None:
            ids = batch.get("input_ids")
            self._monitor.begin_step(self.step, batch_size=int(ids.shape[0]) if ids is not None else None)
            self._in_step = True

    def pre_optim_step(self):
        if self._monitor is not None and self._in_step:
            self._in_step = False
            for name, value in self._monitor.end_step().items():
                self.trainer.record_metric(name, value)  # identical on every rank: no reduction
        if self._dumper is not None:
            self._dumper.maybe_dump(self.step)

    def post_train_batch(self):
        update = self._monitor.last_update_metrics if self._monitor is not None else {}
        if update and update is not self._logged_update:  # the optimizer step after a monitored step
            self._logged_update = update
            for name, value in update.items():
                self.trainer.record_metric(name, value)

    def close(self):
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        if self._dumper is not None:
            self._dumper.close()
            self._dumper = None


def _loss_weights(args: tuple, kwargs: dict, samples: int):
    """Each sample's weight in the loss of one micro-batch's forward call of an OLMo-core model
    (`model(input_ids, labels=..., loss_reduction=..., loss_div_factor=...)`); None (loss_reduction's
    default) when the call computes no loss."""
    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.dim() < 1 or labels.shape[0] != samples:
        return None
    reduction = kwargs.get("loss_reduction", "mean")
    if reduction not in ("mean", "sum"):
        return None  # "none": the caller reduces the per-token losses itself
    tokens = tokens_per_sample(labels, samples, kwargs.get("ignore_index", -100))
    weights = tokens if reduction == "sum" else tokens / tokens.sum().clamp(min=1)
    div = kwargs.get("loss_div_factor")
    if div is not None:
        weights = weights / float(div)
    return weights
