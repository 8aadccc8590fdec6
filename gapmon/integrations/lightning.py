"""GAPMonitor (and optionally GradientDumper) as a PyTorch Lightning callback.

    from gapmon.integrations.lightning import GAPMonitorCallback
    trainer = lightning.Trainer(callbacks=[GAPMonitorCallback(interval=10)])

A step starts at the first batch of each gradient-accumulation window and ends in
`on_before_optimizer_step`: gradient statistics are those of the accumulated gradients, taken
before Lightning clips them. Metrics go to every logger of the Trainer (`trainer.loggers`) at the
Trainer's global step. Under `ModelParallelStrategy` (FSDP2, `fully_shard` in `configure_model`)
the statistics are those of the full, unsharded tensors (tested with 2 CPU processes). Lightning's
`FSDPStrategy` (FSDP1) needs a GPU; GAPMonitor handles FSDP1 with `use_orig_params=True`.

Per-sample gradient norms follow each batch from the tensors Lightning hands to `training_step` (the
ones `batch_inputs` names, else every tensor of the batch with the first one's number of samples), so
a `training_step` that calls `self.model(...)` rather than `self(...)` is followed too. They are the
norms of each sample's own loss: `training_step` is taken to return the mean over its batch of the
samples' losses (the sum with loss_reduction="sum"), which Lightning divides by
`accumulate_grad_batches`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import make_dumper, make_monitor, require, unwrap_optimizer, watch_reduction

pl = require("lightning.pytorch", "lightning", "lightning")

from .._torch_compat import tensor_leaves  # noqa: E402
from ..config import DumpConfig, MonitorConfig  # noqa: E402
from ..dump.dumper import GradientDumper  # noqa: E402
from ..monitor.gap_monitor import GAPMonitor  # noqa: E402
from ..per_sample.micro_batch import batched_in  # noqa: E402
from ..utils import first_tensor  # noqa: E402


def batched_tensors(batch: Any, batch_dim: int, named: list[tuple[Any, int]]) -> list[tuple[torch.Tensor, int]]:
    """The tensors of `batch` that hold its samples, each with the dim that holds them: those `named` picks ((key of a
    dict batch or position of a sequence, dim) pairs: PerSampleConfig.batch_input_dims), else every tensor with the
    first one's size on `batch_dim` (micro_batch.batched_in)."""
    if named:
        picked = [(batch[k], dim) for k, dim in named if (isinstance(batch, dict) and k in batch)
                  or (isinstance(batch, (list, tuple)) and isinstance(k, int) and k < len(batch))]
        return [(t, dim) for p, dim in picked for t in tensor_leaves(p)]
    return batched_in(batch, batch_dim)


class GAPMonitorCallback(pl.Callback):
    """Runs GAPMonitor.begin_step/end_step around each optimizer step of a Lightning Trainer.

    Keyword arguments go to GAPMonitor (interval, params, grads, activations, activation_grads,
    per_sample_grad_norms, ...), or `monitor_config` (a gapmon.MonitorConfig) gives them all. With
    `dump_dir`, a GradientDumper(**dump_kwargs), or one with `dump_config`, also writes gradients there.
    `optimizer_stats=True` also measures what the Trainer's optimizers do on monitored steps (gap/update/...),
    `data_parallel_noise=True` the gradient noise scale from the DDP or FSDP2 reduction (gap/gns/data_parallel/...).
    """

    def __init__(self, dump_dir: str | Path | None = None, dump_kwargs: dict | None = None,
                 monitor_config: MonitorConfig | None = None, dump_config: DumpConfig | None = None,
                 optimizer_stats: bool = False, data_parallel_noise: bool = False, **monitor_kwargs: Any):
        super().__init__()
        self.optimizer_stats, self.data_parallel_noise = optimizer_stats, data_parallel_noise
        self._logged_update: dict[str, float] | None = None
        self.monitor_config, self.monitor_kwargs = monitor_config, monitor_kwargs
        self.dump_dir, self.dump_config, self.dump_kwargs = dump_dir, dump_config, dump_kwargs or {}
        self.monitor: GAPMonitor | None = None
        self.dumper: GradientDumper | None = None
        self.last_metrics: dict[str, float] = {}

    def on_fit_start(self, trainer, pl_module):
        self.monitor = make_monitor(pl_module, self.monitor_config, self.monitor_kwargs)
        self.dumper = make_dumper(pl_module, self.dump_dir, self.dump_config, self.dump_kwargs)

    def on_train_start(self, trainer, pl_module):
        if self.optimizer_stats:
            for optimizer in trainer.optimizers:
                self.monitor.watch_optimizer(unwrap_optimizer(optimizer))
        if self.data_parallel_noise:
            watch_reduction(self.monitor, trainer.strategy.model)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:  # the first batch of an optimizer step
            self.monitor.begin_step(trainer.global_step)
        x = first_tensor(batch)
        if x is not None and x.dim() > 0:
            self.monitor.add_samples(x.shape[0])
        per_sample = self.monitor.per_sample
        if per_sample is not None and self.monitor.monitoring:
            pairs = batched_tensors(batch, per_sample.batch_dim, per_sample.config.batch_input_dims())
            per_sample.begin_forward(*[t for t, _ in pairs], dims=[dim for _, dim in pairs])
            samples = pairs[0][0].shape[pairs[0][1]] if pairs else 0
            share = 1.0 / samples if per_sample.loss_reduction == "mean" else 1.0
            per_sample.set_loss_weights(share / trainer.accumulate_grad_batches)

    def on_before_backward(self, trainer, pl_module, loss):
        if self.monitor is not None and self.monitor.per_sample is not None:
            self.monitor.per_sample.end_forward()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.monitor is not None and self.monitor.per_sample is not None:
            self.monitor.per_sample.end_forward()  # a step whose backward did not run (manual optimisation)
        update = self.monitor.last_update_metrics if self.monitor is not None else {}
        if update and update is not self._logged_update:  # the optimizer step after a monitored step
            self._logged_update = update
            self.last_metrics = {**self.last_metrics, **update}
            for logger in trainer.loggers:
                logger.log_metrics(update, step=self.monitor.last_update_step)

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
