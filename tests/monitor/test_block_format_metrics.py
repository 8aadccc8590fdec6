"""GAPMonitor(block_formats=...): the per-block format metrics of parameters and gradients equal those of
the float64 reference over the same tensors, under FSDP2 (sharded, 2 ranks) those of the whole model; off
by default; unknown formats refused when the monitor is made."""
import math

import pytest
import torch
import torch.distributed as dist
from helpers import cpu_mesh, run_distributed

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


def _merge(rows):
    """Block rows of several tensors of one module merged: sums, min of min_nonzero, max of max_block_ratio."""
    out = rows.sum(0)
    out[..., 9] = rows[..., 9].amin(0)
    out[..., 10] = rows[..., 10].amax(0)
    return out


def test_activation_metrics_match_the_reference_over_micro_batches():
    """Each module output and output gradient of two micro-batches cast with its own scales (amax of that
    tensor), the rows merged: equal to the monitor's activation metrics."""
    model = _model()
    codes = [bf.BLOCK_FORMATS.index(f) for f in FORMATS]
    seen = {"activations": {}, "activation_grads": {}}

    def keep(name):
        def hook(module, args, out):
            seen["activations"].setdefault(name, []).append(out.detach().clone())
            out.register_hook(lambda g: seen["activation_grads"].setdefault(name, []).append(g.detach().clone()))
        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_children()]
    g = torch.Generator().manual_seed(2)
    with gapmon.GAPMonitor(model, block_formats=FORMATS, params=False, grads=False) as mon:
        mon.begin_step(0, batch_size=6)
        for _ in range(2):
            model(torch.randn(3, 40, generator=g)).pow(2).mean().backward()
        got = mon.end_step()
    for h in handles:
        h.remove()
    checked = 0
    for kind, per_module in seen.items():
        for name, tensors in per_module.items():
            rows = torch.stack([reference.block_numerics([t], codes, [t.abs().max().item()])[0] for t in tensors])
            merged = _merge(rows)
            numel = sum(t.numel() for t in tensors)
            for f, fmt in enumerate(FORMATS):
                for field, value in bf.block_metrics(merged[f].tolist(), numel).items():
                    key = f"gap/{kind}/{name}/{fmt}_{field}"
                    if math.isnan(value):
                        assert math.isnan(got[key]), key
                    else:
                        assert got[key] == pytest.approx(value, rel=1e-10), key
                    checked += 1
    assert checked == 2 * 3 * len(FORMATS) * 8


def test_unknown_formats_are_refused_when_the_monitor_is_made():
    with pytest.raises(ValueError, match="unknown format"):
        gapmon.GAPMonitor(_model(), block_formats=("mxfp6",))
    with pytest.raises(ValueError, match="unknown format"):
        gapmon.MonitorConfig(block_formats=("bf16",))


def _fsdp2_worker(rank, world):
    from torch.distributed.fsdp import fully_shard

    mesh = cpu_mesh(world)  # a GPU machine's default mesh would be a CUDA one
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with gapmon.GAPMonitor(model, block_formats=FORMATS) as mon:
        got = _step(model, mon)
    whole = _model()
    with gapmon.GAPMonitor(whole, block_formats=FORMATS, params=False, grads=False) as mon:
        plain = _step(whole, mon)  # every rank ran the same batch: the mean gradient is the same
    _assert_metrics(got, _expected(whole))
    acts = {k: v for k, v in plain.items() if k.startswith("gap/activation") and ("fp" in k.split("/")[-1])}
    assert len(acts) == 2 * 3 * len(FORMATS) * 8
    _assert_metrics(got, acts)  # the sharded model's activations, merged over the ranks, as the plain one's
    # The numerics histogram groups name the layers' own classes, as without FSDP2 (not FSDPLinear).
    seen = []

    class Capture:
        def write(self, step, metrics, info):
            seen.append(info)

        def close(self):
            pass

    model.zero_grad()
    with gapmon.GAPMonitor(model, numerics=("bf16",), sinks=[Capture()]) as mon:
        _step(model, mon)
    if rank == 0:
        groups = set(seen[0]["numerics_histograms"])
        assert {"params/Linear", "grads/Linear", "activations/Linear"} <= groups, groups
        assert not any("FSDP" in g for g in groups), groups
    dist.barrier()


@pytest.mark.multiprocess
def test_fsdp2_sharded_metrics_equal_the_whole_model():
    run_distributed(_fsdp2_worker, 2)


def test_range_bits_of_a_tensor_with_non_finite_elements_is_of_its_finite_ones():
    """range_bits takes the amax from the step's statistics rows; a tensor with an Inf (whose max_abs is not
    finite) has its finite amax measured."""
    model = _model()
    with torch.no_grad():
        model[0].weight[0, 0] = math.inf
    with gapmon.GAPMonitor(model, block_formats=("mxfp8_e4m3",), grads=False, activations=False,
                           activation_grads=False) as mon:
        got = _step(model, mon)
    for name, p in model.named_parameters():
        a = p.detach().abs()
        finite = a[torch.isfinite(a)]
        want = math.log2(finite.max().item() / finite[finite > 0].min().item())
        assert got[f"gap/params/{name}/range_bits"] == pytest.approx(want, rel=1e-12), name
