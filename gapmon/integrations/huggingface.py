"""GAPMonitor (and optionally GradientDumper) inside a Hugging Face `transformers.Trainer`.

    from gapmon.integrations.huggingface import attach
    attach(trainer, interval=10)          # before trainer.train()

The monitor starts at the first micro-batch of each optimizer step and ends just before the
optimizer step, so with gradient accumulation the statistics are those of the accumulated
gradients; activations are averaged over every micro-batch. The Trainer clips gradients
(`max_grad_norm`) before its pre-optimizer-step callback: the gradient statistics are those the
optimizer receives. Metrics go through `trainer.log`, so they reach every reporter the user
configured (TensorBoard, W&B, ...), at the step they belong to, beside the Trainer's own logs
(loss, grad_norm, learning_rate), which are left as they are. `gap/global_batch_size` counts the
samples that were in the step (an epoch's short last batch too).

Per-sample gradient norms are those of each sample's own loss, whatever the Trainer's scaling: for a
causal LM the mean cross entropy of the sample's tokens (labels shifted, -100 ignored), though the
Trainer divides the sum over all tokens of the step by their count (`num_items_in_batch`); for a model
that returns its own mean loss, that mean, though the Trainer divides it by the micro-batches of the
step, or (a model that takes `**kwargs` but builds its own CrossEntropyLoss: BART, T5) does not. A sample with no
label tokens has norm 0. Every tensor of the collated batch holds samples: an encoder-decoder's labels, which it
shifts into its decoder's ids, are followed into the decoder.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from . import make_dumper, make_monitor, require, tokens_per_sample, unwrap_optimizer, watch_micro_batches, watch_reduction

transformers = require("transformers", "huggingface", "transformers")

from ..config import DumpConfig, MonitorConfig  # noqa: E402
from ..dump.dumper import GradientDumper  # noqa: E402
from ..monitor.gap_monitor import GAPMonitor  # noqa: E402


class GAPMonitorTrainerCallback(transformers.TrainerCallback):
    """Runs GAPMonitor.begin_step/end_step around each optimizer step of a Trainer."""

    def __init__(self, trainer: Any, dump_dir: str | Path | None = None, dump_kwargs: dict | None = None,
                 monitor_config: MonitorConfig | None = None, dump_config: DumpConfig | None = None,
                 optimizer_stats: bool = False, data_parallel_noise: bool = False, **monitor_kwargs: Any):
        self.trainer = trainer
        self.optimizer_stats = optimizer_stats  # also the update of the Trainer's optimizer (gap/update/...)
        self.data_parallel_noise = data_parallel_noise  # the noise scale from the DDP or FSDP2 reduction (gap/gns/data_parallel)
        self._logged_update: dict[str, float] | None = None
        self.monitor_config, self.monitor_kwargs = monitor_config, monitor_kwargs
        self.dump_dir, self.dump_config, self.dump_kwargs = dump_dir, dump_config, dump_kwargs or {}
        self.monitor: GAPMonitor | None = None
        self.dumper: GradientDumper | None = None
        self._pending: dict[str, float] = {}
        self._watch = None
        self._shifts: bool | None = None  # whether the model's loss shifts its labels (_loss_shifts_labels)
        self._divides: bool | None = None  # whether the model's loss divides by num_items_in_batch (_loss_divides_by_items)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model = model if model is not None else self.trainer.model
        self.monitor = make_monitor(model, self.monitor_config, self.monitor_kwargs)
        self.dumper = make_dumper(model, self.dump_dir, self.dump_config, self.dump_kwargs)
        self._watch = watch_micro_batches(model, self.monitor, self._loss_weights, collated=True)
        if self.optimizer_stats:
            self.monitor.watch_optimizer(unwrap_optimizer(kwargs.get("optimizer") or self.trainer.optimizer))
        if self.data_parallel_noise:
            watch_reduction(self.monitor, self.trainer.model_wrapped)

    def _loss_weights(self, model_args: tuple, model_kwargs: dict, samples: int) -> torch.Tensor:
        """Each sample's weight in the loss the Trainer backpropagates for this micro-batch (see
        Trainer.compute_loss and training_step), read from what the model's forward is given."""
        labels = model_kwargs.get("shift_labels")
        if labels is None:
            labels = model_kwargs.get("labels")
            if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and self._loss_shifts_labels():
                labels = labels[..., 1:]  # a causal LM predicts token t + 1 at t
        token_level = isinstance(labels, torch.Tensor) and labels.dim() >= 2 and labels.shape[0] == samples
        num_items = model_kwargs.get("num_items_in_batch")
        return self._weights(labels if token_level else None, num_items, samples,
                             num_items is not None and self._loss_divides_by_items())

    def _weights(self, labels: torch.Tensor | None, num_items: Any, samples: int, divides: bool) -> torch.Tensor:
        """Weights of a loss over the label items of `labels` (tokens; None: one item a sample, a mean over the
        micro-batch's samples), divided by `num_items` (`divides`) or by the micro-batch's items, then scaled as
        compute_loss and training_step scale it."""
        trainer = self.trainer
        if labels is not None and divides:
            # sum over the step's tokens / num_items_in_batch (the count over every micro-batch, and ranks)
            weights = tokens_per_sample(labels, samples) / float(num_items)
        elif labels is not None:  # a mean over the micro-batch's tokens
            tokens = tokens_per_sample(labels, samples)
            weights = tokens / tokens.sum().clamp(min=1)
        else:  # the model's own mean over the micro-batch's samples
            weights = torch.full((samples,), 1.0 / samples, dtype=torch.float64)
        if (num_items is not None and trainer.args.average_tokens_across_devices
                and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None)):
            # compute_loss multiplies the loss by the ranks where it passes num_items_in_batch, whatever the model did
            weights = weights * (trainer.accelerator.num_processes // trainer.get_tp_size())
        scaled_for_accumulation = getattr(trainer, "loss_is_scaled_for_ga", None)
        if scaled_for_accumulation is None:
            scaled_for_accumulation = ((trainer.model_accepts_loss_kwargs and num_items is not None)
                                       or trainer.compute_loss_func is not None)
        if not scaled_for_accumulation:  # training_step divides by the micro-batches of the step
            weights = weights / getattr(trainer, "current_gradient_accumulation_steps", trainer.args.gradient_accumulation_steps)
        return weights

    def label_smoothed(self, labels: torch.Tensor, num_items: Any) -> None:
        """The Trainer's LabelSmoother formed this micro-batch's loss from `labels` (shifted as it shifted them), which
        the Trainer took out of the model's inputs: the weights are declared from them (see WeighingLabelSmoother)."""
        monitor = self.monitor
        if monitor is None or monitor.per_sample is None or not monitor.monitoring or not torch.is_grad_enabled():
            return
        labels = labels.reshape(labels.shape[0], -1)  # a classifier's [B] labels: one item a sample
        monitor.per_sample.set_loss_weights(self._weights(labels, num_items, labels.shape[0], num_items is not None))

    def _loss_divides_by_items(self) -> bool:
        """Whether the model's loss divides by the num_items_in_batch the Trainer passes it: the Trainer passes it to any
        forward that takes **kwargs, but only the losses transformers shares (`self.loss_function`) use it; a model that
        builds its own CrossEntropyLoss (BART, T5, LED) takes the mean over its micro-batch's tokens. Read from the
        model's forward; where its source cannot be read, as the Trainer assumes."""
        if self._divides is None:
            model = self.trainer.model
            model = getattr(model, "module", model)  # DDP / DataParallel
            base = getattr(model, "get_base_model", None)  # PEFT
            model = base() if callable(base) else model
            try:
                self._divides = "loss_function" in inspect.getsource(type(model).forward)
            except (OSError, TypeError):
                self._divides = True
        return self._divides

    def _loss_shifts_labels(self) -> bool:
        """Whether the model's own loss shifts its labels (a causal LM's): what a sample's own mean is over. Read from
        the loss function the model calls, not from the Trainer's `_loss_shifts_labels`, which only looks at a
        `loss_type` attribute: GPT2LMHeadModel has none, falls back to the causal-LM loss and shifts, while the Trainer
        counts its step's tokens unshifted (num_items_in_batch is still what it divides by)."""
        if self._shifts is None:
            model = self.trainer.model
            model = getattr(model, "module", model)  # DDP / DataParallel
            loss = getattr(type(model), "loss_function", None)
            if isinstance(loss, property):
                loss = getattr(model, "loss_function", None)
            if loss is not None:
                self._shifts = (getattr(loss, "__name__", "") == "ForCausalLMLoss"
                                and not getattr(getattr(model, "config", None), "is_encoder_decoder", False))
            else:  # no loss_function (transformers before 4.46): a causal LM's loss shifts its labels
                shifts = getattr(self.trainer, "_loss_shifts_labels", None)
                self._shifts = bool(shifts) if shifts is not None else type(model).__name__.endswith(("ForCausalLM",
                                                                                                     "LMHeadModel"))
        return self._shifts

    def on_step_begin(self, args, state, control, **kwargs):
        self.monitor.begin_step(state.global_step)  # the samples are counted as the micro-batches run

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._pending = self.monitor.end_step()
        if self.dumper is not None:
            self.dumper.maybe_dump(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self._pending:  # after global_step += 1: logged under the step the Trainer reports for it
            metrics, self._pending = self._pending, {}
            update = self.monitor.last_update_metrics  # what the optimizer step after end_step did
            if update is not self._logged_update:
                metrics, self._logged_update = {**metrics, **update}, update
            # Trainer.log ends in on_log, which clears control.should_log: the Trainer would then skip
            # its own log of this step (loss, grad_norm, learning_rate). Keep its decision.
            should_log = control.should_log
            self.trainer.log(metrics)
            control.should_log = self.trainer.control.should_log = should_log
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        if self.monitor is not None:
            self.monitor.close()
        if self.dumper is not None:
            self.dumper.close()


def attach(trainer: Any, dump_dir: str | Path | None = None, dump_kwargs: dict | None = None,
           monitor_config: MonitorConfig | None = None, dump_config: DumpConfig | None = None,
           optimizer_stats: bool = False, data_parallel_noise: bool = False,
           **monitor_kwargs: Any) -> GAPMonitorTrainerCallback:
    """Adds a GAPMonitor callback to `trainer`, with GAPMonitor's keyword arguments (interval, params,
    grads, activations, activation_grads, per_sample_grad_norms, ...) or a gapmon.MonitorConfig; with
    `dump_dir`, gradients are also dumped there by a GradientDumper(**dump_kwargs), or one with a
    gapmon.DumpConfig. `optimizer_stats=True` also measures the optimizer's updates on monitored steps
    (GAPMonitor.watch_optimizer: gap/update/...); `data_parallel_noise=True` the gradient noise scale from
    the DDP or FSDP2 reduction (GAPMonitor.watch_data_parallel). Returns the callback."""
    callback = GAPMonitorTrainerCallback(trainer, dump_dir, dump_kwargs, monitor_config, dump_config, optimizer_stats,
                                         data_parallel_noise, **monitor_kwargs)
    if getattr(trainer, "label_smoother", None) is not None and not isinstance(trainer.label_smoother, WeighingLabelSmoother):
        trainer.label_smoother = WeighingLabelSmoother(trainer.label_smoother, callback)
    trainer.add_callback(callback)
    return callback


class WeighingLabelSmoother:
    """The Trainer's LabelSmoother (`label_smoothing_factor`), which then tells the callback the labels it formed the
    loss from: the Trainer takes them out of the model's inputs, where the forward's hook reads them otherwise."""

    def __init__(self, smoother: Any, callback: GAPMonitorTrainerCallback):
        self.smoother, self.callback = smoother, callback

    def __call__(self, model_output: Any, labels: torch.Tensor, shift_labels: bool = False, **kwargs: Any) -> torch.Tensor:
        loss = self.smoother(model_output, labels, shift_labels=shift_labels, **kwargs)
        self.callback.label_smoothed(labels[..., 1:] if shift_labels else labels, kwargs.get("num_items_in_batch"))
        return loss

    def __getattr__(self, name: str) -> Any:  # epsilon, ignore_index: the smoother's own
        return getattr(self.smoother, name)
