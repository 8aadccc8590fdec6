"""Models built the ways large models are built: on the meta device and materialised later
(`to_empty` + init), loaded with `load_state_dict(..., assign=True)` (new Parameter objects), or with a
parameter replaced by assignment. A monitor, dumper or per-sample norms made before any of these
report the model's parameters at each monitored step, checked against float64 references."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import gapmon
from gapmon.monitor.metric_names import metric_name


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def _init(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def _own_norms(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """||grad of sample i's own loss|| by one float64 backward per sample (a copy of the model)."""
    copy = _net().double()
    copy.load_state_dict({k: v.detach().double() for k, v in model.state_dict().items()})
    out = []
    for i in range(x.shape[0]):
        copy.zero_grad()
        nn.functional.mse_loss(copy(x[i:i + 1].double()), y[i:i + 1].double()).backward()
        out.append(float(sum(p.grad.square().sum() for p in copy.parameters())) ** 0.5)
    return out


def _check_step(mon: gapmon.GAPMonitor, model: nn.Module, step: int, where: str) -> None:
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    want_norms = _own_norms(model, x, y)
    mon.begin_step(step, batch_size=5)
    nn.functional.mse_loss(model(x), y).backward()
    metrics = mon.end_step()
    for name, p in model.named_parameters():
        for kind, t in (("params", p.detach()), ("grads", p.grad)):
            want = t.double().norm().item()
            assert metrics[metric_name(kind, name, "norm")] == pytest.approx(want, rel=1e-12), (where, kind, name)
            assert metrics[metric_name(kind, name, "max")] == t.double().abs().max().item(), (where, kind, name)
    assert mon.per_sample.local_norms().tolist() == pytest.approx(want_norms, rel=1e-10), where
    model.zero_grad()


@pytest.mark.parametrize("how", ["meta + to_empty", "load_state_dict(assign=True)", "assignment"])
def test_monitor_and_per_sample_norms_follow_replaced_parameters(how, tmp_path):
    if how == "meta + to_empty":
        with torch.device("meta"):
            model = _net().double()
    else:
        model = _net().double()
        _init(model, 0)
    mon = gapmon.GAPMonitor(model, per_sample_grad_norms=True)
    if how == "meta + to_empty":
        model.to_empty(device="cpu")
        _init(model, 1)
    else:
        _check_step(mon, model, 0, f"{how}, before")
    if how == "load_state_dict(assign=True)":
        fresh = _net().double()
        _init(fresh, 2)
        model.load_state_dict(fresh.state_dict(), assign=True)
    elif how == "assignment":
        model[0].weight = nn.Parameter(torch.full((10, 6), 0.25, dtype=torch.float64))
    _check_step(mon, model, 1, how)
    _check_step(mon, model, 2, f"{how}, the step after")
    mon.close()


@pytest.mark.parametrize("how", ["meta + to_empty", "load_state_dict(assign=True)"])
def test_dumper_writes_the_models_gradients_after_parameters_are_replaced(how, tmp_path):
    if how == "meta + to_empty":
        with torch.device("meta"):
            model = _net()
    else:
        model = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "no gradients to dump"
        dumper = gapmon.GradientDumper(model, tmp_path / "dumps", async_write=False)
        if how == "meta + to_empty":
            model.to_empty(device="cpu")
            _init(model, 1)
        else:
            fresh = _net()
            _init(fresh, 3)
            model.load_state_dict(fresh.state_dict(), assign=True)
        nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()
        assert dumper.maybe_dump(0)
        dumper.close()
    got = gapmon.reconstruct_gradients(tmp_path / "dumps", 0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=0, atol=0)


def _fsdp2_lifecycle_worker(rank: int, world: int):
    """Monitor and per-sample norms made on the meta-device model, then fully_shard per layer, to_empty
    and an assign=True load of DTensors (the torchtitan flow): every rank reports the full tensors'
    statistics and the float64 per-sample norms."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    reference = _net().double()
    _init(reference, 5)
    with torch.device("meta"):
        model = _net().double()
    mon = gapmon.GAPMonitor(model, per_sample_grad_norms=gapmon.PerSampleConfig(strict=True))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.load_state_dict({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in reference.state_dict().items()},
                          assign=True)
    torch.manual_seed(0)  # the same samples on every rank: the reduced gradient is the local one
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    want_norms = _own_norms(reference, x, y)
    nn.functional.mse_loss(reference(x), y).backward()
    mon.begin_step(0, batch_size=5)
    nn.functional.mse_loss(model(x), y).backward()
    metrics = mon.end_step()
    for name, p in reference.named_parameters():
        for kind, t in (("params", p.detach()), ("grads", p.grad)):
            assert metrics[metric_name(kind, name, "norm")] == pytest.approx(t.norm().item(), rel=1e-10), (kind, name)
    assert mon.per_sample.local_norms().tolist() == pytest.approx(want_norms, rel=1e-10)
    mon.close()


@pytest.mark.multiprocess
def test_fsdp2_meta_init_and_assign_load():
    from helpers import run_distributed

    run_distributed(_fsdp2_lifecycle_worker, 2)
