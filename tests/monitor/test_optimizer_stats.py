"""The optimizer statistics (gap/update/...) against float64 copies of the weights taken around step(): SGD
with momentum and weight decay, AdamW (for-loop, foreach and fused), on monitored steps only; under DDP and
FSDP2 (gloo) the same numbers on every rank, from the full tensors."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import cpu_mesh, run_distributed

import gapmon

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=False),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _reference(model, optimizer, before, grads):
    """The statistics from float64 copies of the weights before and after step(), computed with torch ops."""
    out = {}
    lr = optimizer.param_groups[0]["lr"]
    for name, p in model.named_parameters():
        if name not in before:
            continue
        old, new, g = before[name], p.detach().double(), grads[name]
        d = new - old
        out[f"gap/update/{name}/norm"] = d.norm().item()
        out[f"gap/update/{name}/ratio"] = (d.norm() / old.norm()).item()
        out[f"gap/update/{name}/rms"] = (d.norm() / math.sqrt(d.numel())).item()
        out[f"gap/update/{name}/norm_per_lr"] = d.norm().item() / lr
        out[f"gap/update/{name}/cos_neg_grad"] = (-(d * g).sum() / (d.norm() * g.norm())).item()
        state = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out[f"gap/update/{name}/{key}_norm"] = state[key].double().norm().item()
    return out


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_update_statistics_match_float64_copies_on_monitored_steps_only(kind):
    model = _model()
    optimizer = OPTIMIZERS[kind](model.parameters())
    written = []
    with gapmon.GAPMonitor(model, interval=2, sinks=[lambda step, metrics: written.append((step, metrics))],
                           activations=False, activation_grads=False) as mon:
        mon.watch_optimizer(optimizer)
        for step in range(4):
            mon.begin_step(step)
            model(torch.randn(5, 6)).square().mean().backward()
            mon.end_step()
            before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
            grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            want = _reference(model, optimizer, before, grads)
            update = [m for s, m in written if s == step and any(k.startswith("gap/update/") for k in m)]
            if step % 2:
                assert not update  # a skipped step: no copy, no statistics
                continue
            (got,) = update
            assert got == mon.last_update_metrics and set(got) == set(want)
            for key, value in want.items():
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
    assert len([m for _, m in written if any(k.startswith("gap/update/") for k in m)]) == 2


def test_a_step_the_optimizer_skips_is_not_measured_later():
    """An optimizer step skipped after a monitored step (a GradScaler found infs) is not attributed to the
    next monitored step's update: the next begin_step disarms it."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gapmon.GAPMonitor(model, interval=2, activations=False, activation_grads=False) as mon:
        mon.watch_optimizer(optimizer)
        mon.begin_step(0)
        model(torch.randn(3, 6)).sum().backward()
        mon.end_step()  # no optimizer.step() for step 0
        mon.begin_step(1)
        mon.end_step()
        optimizer.step()  # step 1 is not monitored
    assert mon.last_update_metrics == {}


def _parallel_worker(rank, world):
    from torch.distributed.fsdp import fully_shard

    mesh = cpu_mesh(world)  # a GPU machine's default mesh would be a CUDA one
    for wrap in ("ddp", "fsdp2"):
        model = _model()
        if wrap == "ddp":
            wrapped = nn.parallel.DistributedDataParallel(model)
        else:
            for layer in (model[0], model[3]):
                fully_shard(layer, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
            from torch.distributed.fsdp import FSDPModule

            for m in wrapped.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(1.0)  # gloo's AVG reduce-scatter is unreliable: force SUM
                    m.set_force_sum_reduction_for_comms(True)
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        with gapmon.GAPMonitor(wrapped, activations=False, activation_grads=False) as mon:
            mon.watch_optimizer(optimizer)
            for step in range(2):
                mon.begin_step(step)
                torch.manual_seed(100 + rank + 10 * step)
                wrapped(torch.randn(4, 6)).square().mean().backward()
                mon.end_step()
                before = {n: _full(p.detach()).double().clone() for n, p in wrapped.named_parameters()}
                grads = {n: _full(p.grad).double().clone() for n, p in wrapped.named_parameters()}
                optimizer.step()
                got = mon.last_update_metrics
                for name, p in wrapped.named_parameters():
                    full = _full(p.detach()).double()
                    d = full - before[name]
                    g = grads[name]
                    clean = name.replace("module.", "")
                    assert got[f"gap/update/{clean}/norm"] == pytest.approx(d.norm().item(), rel=1e-5), (wrap, name)
                    assert got[f"gap/update/{clean}/ratio"] == pytest.approx((d.norm() / before[name].norm()).item(), rel=1e-5)
                    cos = (-(d * g).sum() / (d.norm() * g.norm())).item()
                    assert got[f"gap/update/{clean}/cos_neg_grad"] == pytest.approx(cos, rel=1e-5, abs=1e-7), (wrap, name)
                    avg = _full(optimizer.state[p]["exp_avg"]).double().norm().item()
                    assert got[f"gap/update/{clean}/exp_avg_norm"] == pytest.approx(avg, rel=1e-6), (wrap, name)
                optimizer.zero_grad()
        dist.barrier()


@pytest.mark.multiprocess
def test_update_statistics_under_ddp_and_fsdp2_are_those_of_the_full_tensors():
    run_distributed(_parallel_worker, 2)


def test_watching_an_optimizer_twice_is_refused_and_close_removes_the_hooks():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gapmon.GAPMonitor(model, activations=False, activation_grads=False)
    mon.watch_optimizer(optimizer)
    with pytest.raises(ValueError, match="watched already"):
        mon.watch_optimizer(optimizer)
    mon.close()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    with pytest.raises(RuntimeError, match="closed"):
        mon.watch_optimizer(optimizer)
