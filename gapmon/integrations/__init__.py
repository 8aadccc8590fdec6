"""gapmon inside the trainers people already use, one module per framework:

- gapmon.integrations.huggingface: `attach(trainer, ...)` for `transformers.Trainer`
- gapmon.integrations.lightning: `GAPMonitorCallback` for `lightning.pytorch.Trainer`
- gapmon.integrations.olmo: `GAPMonitorCallback` for OLMo-core's `Trainer`

Each module imports its framework when it is imported (never `import gapmon` itself); a missing
framework raises ImportError naming the package to install.
"""
from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from .. import _torch_compat
from ..config import DumpConfig, MonitorConfig
from ..dump.dumper import GradientDumper
from ..monitor.gap_monitor import GAPMonitor
from ..utils import first_input


def require(package: str, module: str, install: str) -> object:
    """Imports `package` for integration `module`, or raises ImportError that says what to install."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ImportError(f"gapmon.integrations.{module} needs the '{install}' package: pip install {install}") from e


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind a framework's wrapper (accelerate's AcceleratedOptimizer holds it as
    `.optimizer`): the one whose step() runs, and so its step hooks."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def watch_reduction(monitor: GAPMonitor, wrapped: Any) -> None:
    """monitor.watch_data_parallel on the trainer's DistributedDataParallel wrapper or FSDP2 model; a warning
    (not silence) when the trainer runs without either (one process): there is no reduction to read."""
    from .._torch_compat import fsdp_param_groups

    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) or (
            isinstance(wrapped, torch.nn.Module) and fsdp_param_groups(wrapped)):
        monitor.watch_data_parallel(wrapped)
    else:
        warnings.warn(f"gapmon: data_parallel_noise=True, but the trainer's model is a {type(wrapped).__name__}, neither "
                      "a DistributedDataParallel nor an FSDP2 model: no noise scale from the data-parallel reduction "
                      "(per-sample norms give one: per_sample_grad_norms=True)", RuntimeWarning, stacklevel=3)


def make_monitor(model: Any, config: MonitorConfig | None, options: dict[str, Any]) -> GAPMonitor:
    """A GAPMonitor from a MonitorConfig or from GAPMonitor's keyword arguments (not both)."""
    if config is None:
        return GAPMonitor(model, **options)
    if options:
        raise TypeError(f"gapmon: give the monitor's options either as monitor_config or as keyword arguments, "
                        f"not both (got monitor_config and {sorted(options)})")
    return GAPMonitor.from_config(model, config)


def make_dumper(model: Any, dump_dir: str | Path | None, config: DumpConfig | None,
                options: dict[str, Any]) -> GradientDumper | None:
    """A GradientDumper into `dump_dir` (None: no dumps) from a DumpConfig or from GradientDumper's
    keyword arguments (dump_kwargs; not both)."""
    if dump_dir is None:
        if config is not None or options:
            raise TypeError("gapmon: dump options were given without dump_dir; pass dump_dir to dump gradients")
        return None
    if config is None:
        return GradientDumper(model, dump_dir, **options)
    if options:
        raise TypeError(f"gapmon: give the dumper's options either as dump_config or as dump_kwargs, not both "
                        f"(got dump_config and {sorted(options)})")
    return GradientDumper.from_config(model, dump_dir, config)


# What a trainer's loss is, per micro-batch: (the model's forward args, kwargs, its number of samples) ->
# the weights w with loss = sum_i w[i] * loss_i (see PerSampleGradNorms.set_loss_weights), or None.
LossWeights = Callable[[tuple, dict, int], "float | torch.Tensor | None"]


def watch_micro_batches(model: torch.nn.Module, monitor: GAPMonitor, loss_weights: LossWeights | None,
                        count_samples: bool = True, collated: bool = False) -> torch.utils.hooks.RemovableHandle:
    """A forward pre-hook on the trainer's model that sees each micro-batch of a monitored step: it counts
    its samples (GAPMonitor.add_samples: the samples that were in the step, a short last batch included)
    and, with per-sample norms on, declares how the trainer scales each sample's loss in it
    (`loss_weights`), so that the norms are those of each sample's own loss. Registered after the
    monitor's hooks, so that the micro-batch it describes is the one the norms just opened. `collated`: the trainer
    passes its data loader's batch as the model's arguments, so every tensor argument with the first one's number
    of samples holds samples (an encoder-decoder's labels too), unless the per-sample config names its batch_inputs."""

    def hook(module, args, kwargs):
        if not monitor.monitoring or _torch_compat.in_backward() or _torch_compat.functorch_transforms_active():
            return  # a skipped step, or activation checkpointing recomputing the forward
        if not torch.is_grad_enabled():
            return  # an evaluation or a reference pass of the model inside the step: none of its samples
        x = first_input(args, kwargs)
        if x is None or x.dim() == 0:
            return
        packed = packed_samples(kwargs) if collated else None
        if count_samples:
            monitor.add_samples(x.shape[0] if packed is None else packed)
        per_sample = monitor.per_sample
        if per_sample is None:
            return
        if packed is not None:
            raise RuntimeError(
                f"gapmon: the batch packs {packed} sequences into {x.shape[0]} row(s) (position_ids restart within a "
                "row, as DataCollatorWithFlattening and padding-free training make them): per-sample gradient norms "
                "take each row for a sample, so they are not formed for it. Pad the batch instead "
                "(DataCollatorForLanguageModeling, DataCollatorWithPadding), or turn per_sample_grad_norms off.")
        dim = per_sample.batch_dim
        if collated and per_sample.batch_inputs is None and x.dim() > dim:
            per_sample.mark_batched(*[t for t in _torch_compat.tensor_leaves((args, kwargs))
                                      if t is not x and t.dim() > dim and t.shape[dim] == x.shape[dim]])
        if loss_weights is not None:
            weights = loss_weights(args, kwargs, x.shape[0])
            if weights is not None:  # None: the loss_reduction the norms were configured with
                per_sample.set_loss_weights(weights)

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def packed_samples(kwargs: dict) -> int | None:
    """The number of sequences in a packed batch (several in one row, no padding: position_ids that restart within a
    row, or flash attention's cu_seq_lens_q, as DataCollatorWithFlattening makes them); None when each row is one.
    A padded batch (an attention mask with zeros) is never taken for a packed one: its pads' positions may repeat.
    Reads the positions (a sync on a GPU) where they are given."""
    cu = kwargs.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() > 1:
        return cu.numel() - 1
    pos, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[1] < 2 or pos.is_floating_point():
        return None
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all())):
        return None
    starts = int((pos[:, 1:] <= pos[:, :-1]).sum())  # a row's next sequence starts where its positions restart
    return pos.shape[0] + starts if starts else None


def tokens_per_sample(labels: torch.Tensor, samples: int, ignore_index: int = -100) -> torch.Tensor:
    """The number of labels of each sample that count in the loss (not `ignore_index`), float64."""
    return labels.ne(ignore_index).reshape(samples, -1).sum(1, dtype=torch.float64)
