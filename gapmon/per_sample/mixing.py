"""What mixes the samples of a batch, so that no layer has per-sample gradients of each sample's own loss: BatchNorm
using batch statistics, and a transformers mixture of experts whose loss adds a load-balancing loss of the batch's
routing. Forward pre-hooks record them in the micro-batch (MicroBatch.mixing); the norms are refused when read."""
from __future__ import annotations

import functools
from typing import Callable

import torch.nn as nn

from .. import _torch_compat
from .micro_batch import Collection, MicroBatch
from .rules.mixture_of_experts import load_balancing_loss


class SampleMixing:
    """The hooks on a model's modules that may mix the samples, recording what they did in the current micro-batch of
    `state` while it collects."""

    def __init__(self, model: nn.Module, state: Collection, clean_name: Callable[[str], str]):
        self.state = state
        self._handles = [m.register_forward_pre_hook(functools.partial(self._batch_norm_hook, clean_name(n)))
                         for n, m in model.named_modules() if isinstance(m, _torch_compat.BatchNormBase)]

    def watch_routing(self, model: nn.Module, clean_name: Callable[[str], str]) -> None:
        """Hooks the outermost model with a router config (a MixtralForCausalLM, not its MixtralModel): to be called
        after the hook that opens each micro-batch is registered on the model, so that this one runs after it."""
        routed = [n for n, m in model.named_modules() if hasattr(getattr(m, "config", None), "output_router_logits")]
        routed = [n for n in routed if not any(o != n and (o == "" or n.startswith(f"{o}.")) for o in routed)]
        self._handles += [model.get_submodule(n).register_forward_pre_hook(
            functools.partial(self._routing_hook, clean_name(n)), with_kwargs=True) for n in routed]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _record(self, name: str, why: str, fix: str) -> None:
        if self.state.collecting and self.state.micro and not _torch_compat.functorch_transforms_active():
            self.state.micro[-1].mixing[name] = (why, fix)

    def _batch_norm_hook(self, name: str, module: nn.Module, args) -> None:
        # As F.batch_norm decides: batch statistics in training mode, or without running statistics.
        if module.training or (module.running_mean is None and module.running_var is None):
            self._record(f"{name} ({type(module).__name__})", "normalises with statistics of the whole batch",
                         "Put it in eval mode (running statistics), or replace it (GroupNorm, LayerNorm).")

    def _routing_hook(self, name: str, module: nn.Module, args, kwargs) -> None:
        why = load_balancing_loss(module, kwargs)
        if why:
            self._record(name or type(module).__name__, why,
                         "Measure with output_router_logits=False (or router_aux_loss_coef=0).")


def refuse_batch_mixing(micro: list[MicroBatch]) -> None:
    """RuntimeError naming what mixed the samples of a batch, and how to avoid it."""
    mixing = {name: found for mb in micro for name, found in mb.mixing.items()}
    if mixing:
        what = "; ".join(f"{name} {why}" for name, (why, _) in sorted(mixing.items()))
        fixes = " ".join(dict.fromkeys(fix for _, fix in mixing.values()))
        raise RuntimeError(
            f"PerSampleGradNorms: {what}, which mixes the samples: no layer has per-sample gradients of the form "
            f"gapmon computes, so no norms are returned. {fixes}")
