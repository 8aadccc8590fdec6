"""Test oracles: statistics computed independently, in float64, with plain torch ops."""
from __future__ import annotations

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gapmon


def cpu_isas() -> list[str]:
    """The CPU instruction sets of the compiled kernels this machine supports (none on the pure-torch backend)."""
    if gapmon.backend() == "torch":
        return []
    found, previous = [], gapmon.cpu_isa()
    for isa in ("generic", "avx2", "avx512"):
        try:
            gapmon.cpu_isa(isa)
            found.append(isa)
        except ValueError:
            pass
    gapmon.cpu_isa(previous)
    return found


def float64_stats(x: torch.Tensor, correction: int = 1) -> dict[str, float]:
    """Exact (float64) statistics of the elements of x, with torch's semantics."""
    v = x.detach().double().reshape(-1)
    n = v.numel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        var = torch.var(v, correction=correction).item() if n > 0 else float("nan")
    return {
        "count": float(n),
        "mean": v.mean().item() if n > 0 else float("nan"),
        "var": var,
        "max_abs": v.abs().max().item() if n > 0 else 0.0,
        "norm": torch.linalg.vector_norm(v).item(),
        "nonfinite": float((~torch.isfinite(v)).sum()),
        "zeros": float((v == 0).sum()),
    }


def _close(got: float, want: float, rtol: float, atol: float) -> bool:
    if want != want:
        return got != got
    if abs(want) == float("inf") or abs(got) == float("inf"):
        return got == want
    return abs(got - want) <= atol + rtol * abs(want)


def assert_stats_match(got: gapmon.Stats, want: dict[str, float], rtol: float = 1e-5, where: str = "") -> None:
    """Compares one statistics row with a float64 oracle: counts and max |x| exactly (they are exact
    in the float64 result rows), the rest to `rtol`."""
    assert got.count.dtype == torch.float64, f"{where}: result rows must be float64"
    scale = abs(want["mean"]) + (want["var"] ** 0.5 if want["var"] == want["var"] and want["var"] >= 0 else 0.0)
    for name in gapmon.STAT_NAMES:
        g = float(getattr(got, name))
        w = want[name]
        if name in ("count", "nonfinite", "zeros", "max_abs"):
            ok = (g == w) or (g != g and w != w)
        elif name == "mean":
            ok = _close(g, w, rtol, rtol * scale if scale == scale else 0.0)
        else:
            ok = _close(g, w, rtol, 1e-30)
        assert ok, f"{where} {name}: got {g!r}, float64 oracle {w!r}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Passed: leave without the interpreter's teardown, where gloo's threads rarely abort the process
    # ("terminate called without an active exception", seen once in ~30 runs) after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cpu_mesh(world: int):
    """A 1-D CPU device mesh over the gloo world: fully_shard without a mesh takes the machine's accelerator, so on a
    GPU machine these CPU tests would put every rank's parameters on a GPU (rank 1 on a cuda:1 that may not be)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def run_distributed(fn, world: int, *args) -> None:
    """Runs fn(rank, world, *args) in `world` gloo processes; a failure on any rank fails the test."""
    mp.spawn(_worker, args=(world, free_port(), fn, args), nprocs=world, join=True)


def brute_force_gap_metrics(model: torch.nn.Module, run_step, correction: int = 1) -> dict[str, float]:
    """GAP metrics computed the slow, independent way: keep every module output and output gradient
    (float64 copies), then compute per-instance statistics and their averages with torch ops."""
    from collections import defaultdict

    outs, grads = defaultdict(list), defaultdict(list)
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(mod, args, out, name=name):
            t = out if isinstance(out, torch.Tensor) else next((o for o in out if isinstance(o, torch.Tensor)), None)
            if t is None or t.dim() <= 1 or not t.is_floating_point():
                return
            outs[name].append(t.detach().double().clone())
            if t.requires_grad:
                t.register_hook(lambda g, name=name: grads[name].append(g.detach().double().clone()))

        handles.append(module.register_forward_hook(hook))
    try:
        run_step()
    finally:
        for h in handles:
            h.remove()
    metrics: dict[str, float] = {}
    for kind, store in (("activations", outs), ("activation_grads", grads)):
        for name, tensors in store.items():
            rows = torch.cat([t.reshape(t.shape[0], -1) for t in tensors])
            metrics[f"gap/{kind}/{name}/max"] = rows.abs().max().item()
            metrics[f"gap/{kind}/{name}/mean"] = rows.mean(1).mean().item()
            metrics[f"gap/{kind}/{name}/var"] = rows.var(1, correction=correction).mean().item()
            metrics[f"gap/{kind}/{name}/norm"] = rows.norm(dim=1).mean().item()
            metrics[f"gap/{kind}/{name}/nonfinite"] = float((~torch.isfinite(rows)).sum())
    for name, p in model.named_parameters():
        for kind, t in (("params", p), ("grads", p.grad)):
            if t is None:
                continue
            s = float64_stats(t, correction)
            for field, key in (("max", "max_abs"), ("mean", "mean"), ("var", "var"), ("norm", "norm"),
                               ("nonfinite", "nonfinite")):
                metrics[f"gap/{kind}/{name}/{field}"] = s[key]
    return metrics


def assert_metrics_close(got: dict[str, float], want: dict[str, float], rtol: float = 1e-5, atol: float = 1e-7) -> None:
    """Same metric names (ignoring extra gap/global_batch_size etc. in `got`) and close values."""
    import math

    missing = sorted(set(want) - set(got))
    assert not missing, f"metrics missing: {missing[:10]}"
    extra = sorted(k for k in set(got) - set(want) if k.count("/") == 3)
    assert not extra, f"unexpected metrics: {extra[:10]}"
    bad = [(k, got[k], w) for k, w in want.items()
           if not (math.isclose(got[k], w, rel_tol=rtol, abs_tol=atol) or (math.isnan(w) and math.isnan(got[k])))]
    assert not bad, f"{len(bad)} metrics differ, e.g. {bad[:5]}"


def vmap_per_sample_norms(model: torch.nn.Module, loss_fn, inputs, targets) -> torch.Tensor:
    """Norms of exact per-sample gradients from torch.func.vmap(grad(...)) (gapmon.reference), as float32."""
    return gapmon.reference.per_sample_grad_norms(model, loss_fn, inputs, targets).float()


def seeded_gpt(cfg) -> torch.nn.Module:
    """A TinyGPT with the same initial weights in every process and test."""
    from gapmon.apps.examples import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(cfg)


def loop_per_sample_norms(model: torch.nn.Module, loss_fn, inputs, targets, params: set[str] | None = None) -> torch.Tensor:
    """Per-sample gradient norms by brute force, in float64: one backward per sample of its own loss.

    `params` restricts the norm to those parameter names (default: every trainable parameter)."""
    import copy

    # A float64 model is used as it is (autograd.grad leaves its .grad alone; weight_norm'd modules
    # cannot be deep-copied); any other is copied to float64.
    ref = model if all(p.dtype == torch.float64 for p in model.parameters()) else copy.deepcopy(model).double()
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad and (params is None or n in params)]
    norms = []
    for i in range(len(inputs)):
        x, y = inputs[i:i + 1], targets[i:i + 1]
        x = x.double() if x.is_floating_point() else x
        y = y.double() if y.is_floating_point() else y
        grads = torch.autograd.grad(loss_fn(ref(x), y), [p for _, p in named], allow_unused=True)
        norms.append(torch.sqrt(sum(g.double().square().sum() for g in grads if g is not None)))
    return torch.stack(norms)


def micro_batch_norms(model: torch.nn.Module, loss_fn, x, y, parts) -> torch.Tensor:
    """gapmon's strict per-sample norms of one step of summed-loss micro-batches `parts` (slices of x and y)."""
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    try:
        for part in parts:
            loss_fn(model(x[part]), y[part]).backward()
        return psn.local_norms()
    finally:
        psn.close()


def norms_and_coverage(model: torch.nn.Module, loss_fn, x, y, **kwargs) -> tuple[torch.Tensor, dict]:
    """gapmon's per-sample norms of one summed-loss backward of model(x) (PerSampleGradNorms(model, **kwargs)) and its
    coverage(); the norms are closed after."""
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", **kwargs)
    try:
        loss_fn(model(x), y).backward()
        return psn.local_norms(), psn.coverage()
    finally:
        psn.close()


def assert_kept_under_bf16_autocast(model: torch.nn.Module, loss_fn, x, y, device: str = "cpu") -> None:
    """One summed-loss step of `model` run under bf16 autocast with strict per-sample norms: no layer is left out (the
    use check allows bf16's rounding), and the norms match a float64 loop within it."""
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    try:
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(x)
        loss_fn(out.float(), y).backward()
        got = psn.local_norms()
        assert not psn.coverage()["skipped_layers"]
    finally:
        psn.close()
    torch.testing.assert_close(got.double(), loop_per_sample_norms(model, loss_fn, x, y), rtol=5e-2, atol=1e-3)


class Autocast(torch.nn.Module):
    """Runs the wrapped model under bf16 autocast on `device_type`, as a training loop's
    `with torch.autocast(...)` around the forward pass does."""

    def __init__(self, model: torch.nn.Module, device_type: str):
        super().__init__()
        self.model, self.device_type = model, device_type

    def forward(self, x):
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.model(x)


def reseal_complete(step_dir) -> None:
    """Recomputes the sizes and checksums that step_dir/COMPLETE records for its files (and its own
    seal), as if the files had been written as they are now: lets a test reach the checks behind
    the checksums (a writer that wrote a malformed header with consistent checksums)."""
    import json
    import struct
    import zlib
    from pathlib import Path

    path = Path(step_dir) / "COMPLETE"
    record = json.loads(path.read_text())
    for name, info in record["files"].items():
        data = (Path(step_dir) / name).read_bytes()
        info["bytes"] = len(data)
        if "header_crc32" in info:
            (size,) = struct.unpack("<Q", data[:8])
            info["header_crc32"] = zlib.crc32(data[:8 + size])
        else:
            info["crc32"] = zlib.crc32(data)
    record.pop("record_crc32", None)
    record["record_crc32"] = zlib.crc32(json.dumps(record, sort_keys=True).encode())
    path.write_text(json.dumps(record))


def memory_logger(pl, records: list, keep):
    """A Lightning logger class that appends (step, keep(metrics)) to `records`."""
    class Logger(pl.loggers.Logger):
        name, version = "memory", 0

        @property
        def experiment(self):
            return None

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            records.append((step, keep(metrics)))

    return Logger


def regression_module(pl, training_step=None):
    """A LightningModule class: a small MLP regressor (`self.net`, 6 -> 1) trained by SGD on (x, y) batches with
    the mean squared error, or with `training_step(module, batch)` where given."""
    import torch.nn as nn

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            if training_step is not None:
                return training_step(self, batch)
            x, y = batch
            return ((self.net(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module
