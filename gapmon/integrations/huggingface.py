"""GAPMonitor (and optionally GradientDumper) inside a Hugging Face `transformers.Trainer`.

    from gapmon.integrations.huggingface import attach
    attach(trainer, interval=10)          # before trainer.train()

The monitor starts at the first micro-batch of each optimizer step and ends just before the
optimizer step, so with gradient accumulation the statistics are those of the accumulated
gradients; activations are averaged over every micro-batch. The Trainer clips gradients
(`max_grad_norm`) before its pre-optimizer-step callback: the gradient statistics are those the
optimizer receives. Metrics go through `trainer.log`, so they reach every reporter the user
configured (TensorBoard, W&B, ...), at the step they belong to.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from . import make_dumper, make_monitor, require

transformers = require("transformers", "huggingface", "transformers")

from ..config import DumpConfig, MonitorConfig  # noqa: E402
from ..dump import GradientDumper  # noqa: E402
from ..monitor import GAPMonitor  # noqa: E402


class GAPMonitorTrainerCallback(transformers.TrainerCallback):
    """Runs GAPMonitor.begin_step/end_step around each optimizer step of a Trainer."""

    def __init__(self, trainer: Any, dump_dir: str | Path | None = None, dump_kwargs: dict | None = None,
                 monitor_config: MonitorConfig | None = None, dump_config: DumpConfig | None = None,
                 **monitor_kwargs: Any):
        self.trainer = trainer
        self.monitor_config, self.monitor_kwargs = monitor_config, monitor_kwargs
        self.dump_dir, self.dump_config, self.dump_kwargs = dump_dir, dump_config, dump_kwargs or {}
        self.monitor: GAPMonitor | None = None
        self.dumper: GradientDumper | None = None
        self._pending: dict[str, float] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model = model if model is not None else self.trainer.model
        self.monitor = make_monitor(model, self.monitor_config, self.monitor_kwargs)
        self.dumper = make_dumper(model, self.dump_dir, self.dump_config, self.dump_kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self.monitor.begin_step(state.global_step, batch_size=samples)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._pending = self.monitor.end_step()
        if self.dumper is not None:
            self.dumper.maybe_dump(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self._pending:  # after global_step += 1: logged under the step the Trainer reports for it
            metrics, self._pending = self._pending, {}
            self.trainer.log(metrics)

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.close()
        if self.dumper is not None:
            self.dumper.close()


def attach(trainer: Any, dump_dir: str | Path | None = None, dump_kwargs: dict | None = None,
           monitor_config: MonitorConfig | None = None, dump_config: DumpConfig | None = None,
           **monitor_kwargs: Any) -> GAPMonitorTrainerCallback:
    """Adds a GAPMonitor callback to `trainer`, with GAPMonitor's keyword arguments (interval, params,
    grads, activations, activation_grads, per_sample_grad_norms, ...) or a gapmon.MonitorConfig; with
    `dump_dir`, gradients are also dumped there by a GradientDumper(**dump_kwargs), or one with a
    gapmon.DumpConfig. Returns the callback."""
    callback = GAPMonitorTrainerCallback(trainer, dump_dir, dump_kwargs, monitor_config, dump_config, **monitor_kwargs)
    trainer.add_callback(callback)
    return callback
