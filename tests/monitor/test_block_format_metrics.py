"""GAPMonitor(block_formats=...): the per-block format metrics of parameters and gradients equal those of
the float64 reference over the same tensors, under FSDP2 (sharded, 2 ranks) those of the whole model; off
by default; unknown formats refused when the monitor is made."""
import math

import pytest
import torch
import torch.distributed as dist
from helpers import run_distributed

import gapmon
from gapmon.stats import block_formats as bf
from gapmon.stats import reference

FORMATS = ("mxfp8_e4m3", "mxfp4", "nvfp4", "fp8_e5m2_current")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 70), torch.nn.GELU(), torch.nn.Linear(70, 5))


def _step(model, monitor):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 40, generator=g)
    monitor.begin_step(0, batch_size=6)
    model(x).pow(2).mean().backward()
    return monitor.end_step()


def _expected(model):
    """The metrics from the reference casts of every parameter and gradient, float64 throughout."""
    want = {}
    codes = [bf.BLOCK_FORMATS.index(f) for f in FORMATS]
    for name, p in model.named_parameters():
        for kind, t in (("params", p.detach()), ("grads", p.grad)):
            a = t.abs()
            amax = a.max().item()
            rows = reference.block_numerics([t], codes, [amax])[0]
            for f, fmt in enumerate(FORMATS):
                for field, value in bf.block_metrics(rows[f].tolist(), t.numel()).items():
                    want[f"gap/{kind}/{name}/{fmt}_{field}"] = value
            want[f"gap/{kind}/{name}/range_bits"] = math.log2(amax / a[a > 0].min().item())
    return want


def _assert_metrics(got, want):
    for key, value in want.items():
        assert key in got, key
        if math.isnan(value):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, rel=1e-10, abs=0), key


def test_metrics_match_the_reference_and_are_off_by_default():
    model = _model()
    with gapmon.GAPMonitor(model, block_formats=FORMATS, activations=False, activation_grads=False) as mon:
        got = _step(model, mon)
    _assert_metrics(got, _expected(model))
    assert sum("_sqnr_db" in k for k in got) == 2 * 4 * len(FORMATS)
    model.zero_grad()
    with gapmon.GAPMonitor(model, activations=False, activation_grads=False) as mon:
        plain = _step(model, mon)
    assert not any("mxfp" in k or "range_bits" in k for k in plain)


def test_unknown_formats_are_refused_when_the_monitor_is_made():
    with pytest.raises(ValueError, match="unknown format"):
        gapmon.GAPMonitor(_model(), block_formats=("mxfp6",))
    with pytest.raises(ValueError, match="unknown format"):
        gapmon.MonitorConfig(block_formats=("bf16",))


def _fsdp2_worker(rank, world):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    with gapmon.GAPMonitor(model, block_formats=FORMATS, activations=False, activation_grads=False) as mon:
        got = _step(model, mon)
    whole = _model()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 40, generator=g)
    whole(x).pow(2).mean().backward()  # every rank ran the same batch: the mean gradient is the same
    _assert_metrics(got, _expected(whole))
    dist.barrier()


@pytest.mark.multiprocess
def test_fsdp2_sharded_metrics_equal_the_whole_model():
    run_distributed(_fsdp2_worker, 2)
