"""Baseline for bench_monitor.py: the seed GAP callback's approach in pure PyTorch.

Hooks compute each statistic with its own torch ops per tensor (abs().max(), var_mean, norm,
isfinite), and parameters/gradients are measured one tensor at a time. To be fair it keeps the
results on the device and copies them to the host once per step, like GAPMonitor.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn


class TorchGAPMonitor:
    def __init__(self, model: nn.Module):
        self.model = model
        self._values: list[torch.Tensor] = []
        self._names: list[str] = []
        self.active = True  # hooks return at once when False (like GAPMonitor on skipped steps)
        self._handles = [
            m.register_forward_hook(functools.partial(self._forward_hook, n)) for n, m in model.named_modules() if n
        ]

    @torch.no_grad()
    def _instance(self, kind: str, name: str, t: torch.Tensor) -> None:
        t = t.detach().reshape(t.shape[0], -1).float()
        var, mean = torch.var_mean(t, dim=-1)
        self._names.append(f"gap/{kind}/{name}")
        self._values.append(torch.stack((t.abs().max(), mean.mean(), var.mean(), t.norm(dim=-1).mean(),
                                         (~torch.isfinite(t)).sum().float())))

    def _forward_hook(self, name, module, args, out):
        if not self.active:
            return
        if isinstance(out, tuple):
            out = out[0]
        if not isinstance(out, torch.Tensor) or out.dim() <= 1:
            return
        self._instance("activations", name, out)
        if out.requires_grad:
            out.register_hook(lambda g: self._instance("activation_grads", name, g))

    @torch.no_grad()
    def end_step(self) -> dict[str, float]:
        if not self.active:
            return {}
        for n, p in self.model.named_parameters():
            for kind, t in (("params", p), ("grads", p.grad)):
                if t is None:
                    continue
                t = t.detach().float()
                var, mean = torch.var_mean(t)
                self._names.append(f"gap/{kind}/{n}")
                self._values.append(torch.stack((t.abs().max(), mean, var, t.norm(), (~torch.isfinite(t)).sum().float())))
        host = torch.stack(self._values).cpu().tolist()
        out = {}
        for name, row in zip(self._names, host):
            for field, v in zip(("max", "mean", "var", "norm", "nonfinite"), row):
                out[f"{name}/{field}"] = v
        self._values.clear()
        self._names.clear()
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
