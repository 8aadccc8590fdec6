"""GAPMonitor: statistics of gradients, activations and parameters at every monitored step.

Activations and activation gradients are folded, inside the hooks, into one preallocated
device buffer with one fused op per hook call (monitor.activations). Parameters and gradients are
measured at `end_step` with one `multi_tensor_stats` over all of them (monitor.tensor_rows: DTensors
merged exactly across shards, with one collective). Activation sums and maxima are reduced across
ranks with one SUM and one MAX all-reduce, and everything reaches the host in one device-to-host copy
(monitor.step_buffer). No `.item()` per metric.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import MonitorConfig, PerSampleConfig, Schedule, per_sample_option
from ..utils import ParameterWatch, check_int, check_step, clean_named, layer_type_name, rank_and_world
from .activations import ActivationRecorder
from .block_format_metrics import BlockFormatMetrics
from .data_parallel import DataParallelNoise
from .fully_sharded_noise import FullyShardedNoise
from .metric_names import BLOCK_FORMAT_FIELDS, FIELD_COLUMNS, GLOBAL_BATCH_SIZE, NUMERICS_FIELDS
from .noise_scale import NoiseScale
from .nonfinite import localise_nonfinite
from .numerics_metrics import NumericsMetrics
from .optimizer_stats import OptimizerStats
from .per_sample_metrics import PerSampleMetrics
from .readout import StepReadout, reduced_step
from .sinks import Sink
from .step_forwards import StepForwards
from .tensor_rows import WatchedTensors


class GAPMonitor:
    """Monitors a model's gradients, activations and parameters every `interval` steps.

    Call `begin_step(step, batch_size)` before the forward passes of a step and `end_step()` after
    the backward passes (before `optimizer.step()`/`zero_grad()`); gradient accumulation over any
    number of micro-batches is fine. `end_step` returns the metrics of the step (empty on skipped
    steps) and sends them to the sinks (rank 0 only).

    Metric names: ``gap/{params|grads|activations|activation_grads}/{name}/{max|mean|var|norm|nonfinite}``.
    Parameter and gradient statistics are those of the full (unsharded) tensors. Activation statistics
    are per instance (dim 0) and then: `max` is the max over instances; `mean`, `var` and `norm` are
    averages over all instances of the global batch (micro-batches and data-parallel ranks); `nonfinite`
    is the total count.

    Args:
        model: the module to watch (plain, DDP, or FSDP2 `fully_shard`ed, 1-D or HSDP mesh).
        interval: measure every `interval` steps (steps where step % interval == 0), or the steps of
            a gapmon.Schedule (every, start, end).
        params, grads, activations, activation_grads: which kinds to measure.
        per_sample_grad_norms: also compute per-sample gradient norms (see gapmon.PerSampleGradNorms):
            True, or a gapmon.PerSampleConfig with their options (loss_reduction, strict, batch_dim, ...).
        bookkeeping: with per_sample_grad_norms, form the weight gradients of direct-form Linear layers
            from their per-sample gradients (see gapmon.per_sample.bookkeeping): the norms cost no extra GEMM.
        sinks: where metrics go: gapmon sinks or callables fn(step, metrics). Default: none (the
            metrics are returned by end_step; nothing is written unless a sink is given).
        process_group: the data-parallel group over which activations are averaged (default: world).
        correction: Bessel correction of the variances (default 1, like torch.var).
        numerics: formats (of gapmon.numerics.FORMATS: "bf16", "fp16", "fp8_e4m3", "fp8_e5m2") whose
            underflow/overflow shares to report for parameters, gradients and the monitored activations
            and activation gradients (over all their elements, micro-batches and ranks), with their kurtosis
            (fields NUMERICS_FIELDS; parameters and gradients in their statistics' pass on CPU, one more
            pass elsewhere), and their exponent histograms summed per kind and layer type (info["numerics_histograms"]: {"grads/Linear": {"e-7": n,
            ...}}; histograms in TensorBoard and W&B), with the elements of each group that under/overflow
            at their tensor's own power-of-two scale (info["numerics_scaled"]: {"grads/Linear": {"fp8_e4m3":
            {"underflow": n, "overflow": n}}}: what a scaled recipe sees). Groups without elements are left
            out. Default: none (no cost).
        numerics_alert: with numerics, warn (naming tensors and step) when a tensor's unscaled underflow
            or overflow share in a format exceeds this fraction; also listed in the sinks' info.
        gns_ema: with per_sample_grad_norms, the decay of the moving averages behind the gradient noise scale
            ``gap/gns/{all|layer type}/b_simple`` (see gapmon.monitor.noise_scale; default 0.95).
        block_formats: per-block formats (gapmon.stats.block_formats: "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4",
            "nvfp4", "fp8_e4m3_current", "fp8_e5m2_current") whose exact casts to emulate on the parameters,
            gradients and monitored activations and activation gradients (each cast with its own scales,
            merged over micro-batches and ranks): ``gap/{kind}/{name}/{format}_{field}`` (field:
            block_underflow, subnormal, saturated, scale_underflow, scale_overflow, mse, sqnr_db,
            block_range_bits) and, for parameters and gradients, ``gap/{kind}/{name}/range_bits``.
            Default: none (no cost).

    The options are validated once, into `self.config` (a gapmon.MonitorConfig);
    `GAPMonitor.from_config(model, config)` takes one directly.
    """

    def __init__(
        self,
        model: nn.Module,
        interval: int | Schedule = 1,
        params: bool = True,
        grads: bool = True,
        activations: bool = True,
        activation_grads: bool = True,
        per_sample_grad_norms: bool | PerSampleConfig = False,
        bookkeeping: bool = False,
        sinks: Sequence[Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        correction: int = 1,
        numerics: Sequence[str] = (),
        numerics_alert: float | None = None,
        gns_ema: float = 0.95,
        block_formats: Sequence[str] = (),
    ):
        config = MonitorConfig(
            schedule=interval, params=params, grads=grads, activations=activations,
            activation_grads=activation_grads, per_sample=per_sample_option(per_sample_grad_norms, bookkeeping, process_group),
            sinks=tuple(sinks or ()), process_group=process_group, correction=correction, numerics=numerics,
            numerics_alert=numerics_alert, gns_ema=gns_ema, block_formats=tuple(block_formats))
        self._setup(model, config)

    @classmethod
    def from_config(cls, model: nn.Module, config: MonitorConfig) -> "GAPMonitor":
        """A monitor of `model` with the options of `config` (a gapmon.MonitorConfig)."""
        if not isinstance(config, MonitorConfig):
            raise TypeError(f"GAPMonitor.from_config: config must be a gapmon.MonitorConfig, got {type(config).__name__}")
        # Through the constructor, so that a subclass's __init__ runs; the config it rebuilds equals `config`.
        return cls(model, **config.constructor_arguments())

    def _setup(self, model: nn.Module, config: MonitorConfig) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"GAPMonitor: model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config  # every option, read from here
        self.model = model
        self.sinks: list[Sink] = list(config.sinks)
        # The root module (and a wrapper's inner root, e.g. DDP's `module`) is not an activation source.
        modules = [(n, m) for n, m in clean_named(model, model.named_modules(), "modules") if n]
        self._module_types = {n: layer_type_name(m) for n, m in modules}  # numerics histogram groups (Linear, not FSDPLinear)
        self._watch = ParameterWatch(model)
        self._tensors = WatchedTensors(model, modules, real_only=config.params or config.grads)
        # (before the recorder's hooks: the root's pre-hook says whether the forward pass is the step's)
        self._forwards = StepForwards(model) if config.activations else None
        self._recorder = ActivationRecorder(modules, config.activations, config.activation_grads,
                                            config.correction, bool(config.numerics), config.block_formats,
                                            self._forwards)
        self._numerics = NumericsMetrics(config.numerics, config.numerics_alert, self._layer_type, self._recorder,
                                         config.process_group) if config.numerics else None
        self._block_formats = BlockFormatMetrics(config.block_formats, self._recorder) if config.block_formats else None
        self._readout = StepReadout(self._recorder)
        self.per_sample = None
        if config.per_sample is not None:
            from ..per_sample import PerSampleGradNorms

            per_sample = config.per_sample
            if per_sample.process_group is None:  # the monitor's group, unless it names its own
                per_sample = dataclasses.replace(per_sample, process_group=config.process_group)
            self.per_sample = PerSampleGradNorms.from_config(model, per_sample)
            self.per_sample.pause()  # collects from begin_step to end_step of monitored steps
        self._per_sample_metrics = None if self.per_sample is None else PerSampleMetrics(
            self.per_sample, config.gns_ema, config.grads, config.process_group)
        self._step: int | None = None
        self._batch_size = 0
        self._optimizers: list[OptimizerStats] = []
        self._data_parallel: DataParallelNoise | None = None
        self.last_update_metrics: dict[str, float] = {}  # of the latest measured optimizer step (watch_optimizer)
        self.last_update_step: int | None = None  # the step they belong to
        self.nonfinite_report: dict[str, Any] = {}
        self.closed = False

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Also measures what `optimizer` does in its first step() after each monitored step's begin_step:
        ``gap/update/{parameter}/{field}`` (gapmon.monitor.optimizer_stats), sent to the sinks under that
        step (rank 0) and kept in `last_update_metrics`. Costs nothing on skipped steps."""
        self._check_open()
        if any(watched.optimizer is optimizer for watched in self._optimizers):
            raise ValueError("GAPMonitor.watch_optimizer: this optimizer is watched already (each update would be "
                             "reported twice)")
        self._optimizers.append(OptimizerStats(
            optimizer, lambda: {id(p): n for n, p in self._tensors.params}, self._emit_update))

    def watch_data_parallel(self, model: nn.Module) -> None:
        """Also estimates the gradient noise scale from the data-parallel reduction (no per-sample norms
        needed) and reports each rank's local gradient norm (gapmon.monitor.data_parallel). `model`: a
        DistributedDataParallel (registers its one communication hook) or a model with FSDP2/HSDP modules
        (wraps their reduce-scatter; after the model's own FSDP settings). Needs the step's batch size
        (begin_step's batch_size or add_samples)."""
        self._check_open()
        if self._data_parallel is not None:
            raise ValueError("GAPMonitor.watch_data_parallel: a data-parallel model is watched already (its "
                             "reduction would be measured twice)")
        noise = NoiseScale(self.config.gns_ema)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self._data_parallel = DataParallelNoise(model, noise, self.config.process_group)
        else:
            self._data_parallel = FullyShardedNoise(model, noise, self.config.process_group)

    def _emit_update(self, step: int, metrics: dict[str, float]) -> None:
        self.last_update_metrics, self.last_update_step = metrics, step
        if rank_and_world()[0] == 0:
            for sink in self.sinks:
                sink.write(step, metrics, {})

    def _layer_type(self, kind: str, name: str) -> str:
        """The type of the layer a numerics row belongs to (its histogram group)."""
        types = self._tensors.types if kind in ("params", "grads") else self._module_types
        return types.get(name, "Parameter")

    # ---------------------------------------------------------------- steps
    def begin_step(self, step: int, batch_size: int | None = None, sample_ids: Any = None) -> None:
        """Starts step `step` (a non-negative integer); `batch_size` is this rank's number of samples
        in the step (all micro-batches). `sample_ids` (per-sample norms on): the ids of this rank's samples
        in the step, in order; the noise scale then counts a sample several ranks hold once."""
        self._check_open()
        step = check_step(step, "GAPMonitor.begin_step")
        if batch_size is not None:
            batch_size = check_int(batch_size, "GAPMonitor.begin_step", "batch_size")
        if self._per_sample_metrics is not None:
            self._per_sample_metrics.set_sample_ids(sample_ids)
        elif sample_ids is not None:
            raise ValueError("GAPMonitor.begin_step: sample_ids serve the per-sample noise scale; turn on "
                             "per_sample_grad_norms=True")
        self._step = step
        active = self._recorder.active = self.config.schedule.includes(step)
        for watched in self._optimizers:  # its next step() is this step's update (a closure runs inside it)
            watched.arm(step if active else None)
        if self._data_parallel is not None:
            self._data_parallel.begin(active)
        if self.per_sample is not None and active:
            self.per_sample.start()
        elif self.per_sample is not None:
            self.per_sample.pause()  # skipped steps: its hooks return at once
        if not active:
            return
        if self._watch.changed():
            self._tensors.derive()
        self._batch_size = batch_size or 0
        self._recorder.begin(self.model)
        if self._forwards is not None:
            self._forwards.new_step()

    @property
    def monitoring(self) -> bool:
        """Whether a monitored step is open (between begin_step of a scheduled step and end_step)."""
        return self._recorder.active

    def add_samples(self, n: int, sample_ids: Any = None) -> None:
        """Counts `n` more samples of this rank in the current step, for loops that learn the batch
        size one micro-batch at a time (instead of passing batch_size to begin_step); `sample_ids`: their
        ids (see begin_step)."""
        n = check_int(n, "GAPMonitor.add_samples", "n")
        if self._recorder.active:
            self._batch_size += n
            if sample_ids is not None:
                if self._per_sample_metrics is None:
                    raise ValueError("GAPMonitor.add_samples: sample_ids serve the per-sample noise scale; turn on "
                                     "per_sample_grad_norms=True")
                self._per_sample_metrics.add_sample_ids(sample_ids, n)

    def end_step(self) -> dict[str, float]:
        """Metrics of the step (after backward, before the optimizer step); {} on skipped steps."""
        self._check_open()
        if self._step is None:
            raise RuntimeError("GAPMonitor.end_step: call begin_step(step, batch_size) before the forward pass")
        step, active = self._step, self._recorder.active
        self._step, self._recorder.active = None, False
        if self._data_parallel is not None:
            self._data_parallel.active = False  # the backward passes of this step are over
        if self.per_sample is not None:
            self.per_sample.pause()  # until the next begin_step: plain steps cost nothing
        if not active:
            return {}
        metrics, info = self._collect(step)
        if rank_and_world()[0] == 0:
            for sink in self.sinks:
                sink.write(step, metrics, info)
        return metrics

    def _collect(self, step: int) -> tuple[dict[str, float], dict[str, Any]]:
        config, recorder = self.config, self._recorder
        names, tensors, groups = self._tensors.gather(config.params, config.grads)
        device = tensors[0].device if tensors else (recorder.acc.device if recorder.acc is not None else torch.device("cpu"))
        formats = config.block_formats if self._block_formats is not None else ()
        rows, numerics_rows, block_rows = self._tensors.rows_and_blocks(tensors, groups, config.correction,
                                                                        bool(config.numerics), formats, device)
        parts = [p for p in (self._per_sample_metrics, self._data_parallel, self._block_formats) if p is not None]
        out = reduced_step(recorder.accumulator(device), self._batch_size, config.process_group, parts)
        out.add("rows", rows)
        numerics = self._numerics.on_device(names, tensors, groups, out, numerics_rows) if self._numerics else None
        if self._block_formats is not None:
            self._block_formats.tensors_on_device(names, tensors, groups, rows, out, block_rows)
        host = out.cat().cpu().tolist()  # the one device-to-host copy
        metrics = self._readout.tensor_metrics(names, out, host)
        if self._block_formats is not None:
            metrics.update(self._block_formats.metrics(out, host))
            self._readout.copy_to_aliases(metrics, BLOCK_FORMAT_FIELDS)
        metrics.update(self._readout.module_metrics(out, host))
        self._readout.copy_to_aliases(metrics, FIELD_COLUMNS)  # modules that output the same tensor as another
        recorder.share_order_with_aliases()
        (global_batch,) = out.of(host, "batch")
        if self._batch_size or global_batch:
            metrics[GLOBAL_BATCH_SIZE] = global_batch
        if self._data_parallel is not None and global_batch > 0:
            metrics.update(self._data_parallel.metrics(out.of(host, "data_parallel"), global_batch / rank_and_world(
                self.config.process_group)[1], global_batch))
        if self._per_sample_metrics is not None:
            metrics.update(self._per_sample_metrics.metrics(out, host, metrics))
        self.nonfinite_report = localise_nonfinite(metrics, [n for n, _ in recorder.modules], recorder.first_seen, step)
        info: dict[str, Any] = {"nonfinite": self.nonfinite_report} if self.nonfinite_report else {}
        if numerics is not None:
            self._numerics.add(metrics, info, numerics, out, host, step)
            self._readout.copy_to_aliases(metrics, NUMERICS_FIELDS)  # numerics of a shared output, as its statistics
        return metrics, info

    # ---------------------------------------------------------------- lifetime
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("GAPMonitor: the monitor is closed")

    def close(self) -> None:
        """Removes every hook and closes the sinks (idempotent)."""
        if self.closed:
            return
        self._recorder.close()
        if self._forwards is not None:
            self._forwards.close()
        for watched in self._optimizers:
            watched.close()
        if self.per_sample is not None:
            self.per_sample.close()
        for sink in self.sinks:
            sink.close()
        self.closed = True

    def __enter__(self) -> "GAPMonitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
