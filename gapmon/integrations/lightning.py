"""GAPMonitor (and optionally GradientDumper) as a PyTorch Lightning callback.

    from gapmon.integrations.lightning import GAPMonitorCallback
    trainer = lightning.Trainer(callbacks=[GAPMonitorCallback(interval=10)])

A step starts at the first batch of each gradient-accumulation window and ends in
`on_before_optimizer_step`: gradient statistics are those of the accumulated gradients, taken
before Lightning clips them. Metrics go to every logger of the Trainer (`trainer.loggers`) at the
Trainer's global step. Under `ModelParallelStrategy` (FSDP2, `fully_shard` in `configure_model`)
the statistics are those of the full, unsharded tensors (tested with 2 CPU processes). Lightning's
`FSDPStrategy` (FSDP1) needs a GPU; GAPMonitor handles FSDP1 with `use_orig_params=True`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from . import make_dumper, make_monitor, require

pl = require("lightning.pytorch", "lightning", "lightning")

from ..config import DumpConfig, MonitorConfig  # noqa: E402
from ..dump import GradientDumper  # noqa: E402
from ..monitor import GAPMonitor  # noqa: E402
from ..utils import first_tensor  # noqa: E402


class GAPMonitorCallback(pl.Callback):
    """Runs GAPMonitor.begin_step/end_step around each optimizer step of a Lightning Trainer.

    Keyword arguments go to GAPMonitor (interval, params, grads, activations, activation_grads,
    per_sample_grad_norms, ...), or `monitor_config` (a gapmon.MonitorConfig) gives them all. With
    `dump_dir`, a GradientDumper(**dump_kwargs), or one with `dump_config`, also writes gradients there.
    """

    def __init__(self, dump_dir: str | Path | None = None, dump_kwargs: dict | None = None,
                 monitor_config: MonitorConfig | None = None, dump_config: DumpConfig | None = None,
                 **monitor_kwargs: Any):
        super().__init__()
        self.monitor_config, self.monitor_kwargs = monitor_config, monitor_kwargs
        self.dump_dir, self.dump_config, self.dump_kwargs = dump_dir, dump_config, dump_kwargs or {}
        self.monitor: GAPMonitor | None = None
        self.dumper: GradientDumper | None = None
        self.last_metrics: dict[str, float] = {}

    def on_fit_start(self, trainer, pl_module):
        self.monitor = make_monitor(pl_module, self.monitor_config, self.monitor_kwargs)
        self.dumper = make_dumper(pl_module, self.dump_dir, self.dump_config, self.dump_kwargs)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:  # the first batch of an optimizer step
            self.monitor.begin_step(trainer.global_step)
        x = first_tensor(batch)
        if x is not None and x.dim() > 0:
            self.monitor.add_samples(x.shape[0])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        metrics = self.monitor.end_step()
        if self.dumper is not None:
            self.dumper.maybe_dump(trainer.global_step)
        if metrics:
            self.last_metrics = metrics
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def on_fit_end(self, trainer, pl_module):
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer, pl_module, stage):
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        if self.dumper is not None:
            self.dumper.close()
            self.dumper = None
