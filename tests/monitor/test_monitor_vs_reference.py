"""GAPMonitor is never silently wrong (issue 21, items 1-6 and 12): in-place activations, names with
"/", empty, sparse and complex parameters, inference mode, step types, whole-line JSONL records."""
import errno
import json
import logging
import math
import os
import shutil
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from helpers import assert_metrics_close, brute_force_gap_metrics, float64_stats

import gapmon
from gapmon.apps.report import make_report
from gapmon.monitor.metric_names import metric_name, parse_metric_name


def _step(mon, model, x, step=0):
    mon.begin_step(step, batch_size=x.shape[0])
    model(x).square().sum().backward()
    return mon.end_step()


class Residual(nn.Module):
    """`h = proj(x); h += x`: a module's output modified in place by its caller."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.inplace = inplace
        self.proj, self.out = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.proj(x)
        if self.inplace:
            h += x
        else:
            h = h + x
        return self.out(h)


@pytest.mark.parametrize("make", [
    lambda inplace: nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=inplace), nn.Linear(16, 4)),
    lambda inplace: nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=inplace), nn.Dropout(0.0, inplace=inplace),
                                  nn.Linear(16, 16), nn.ReLU(inplace=inplace), nn.Linear(16, 4)),
    lambda inplace: nn.Sequential(nn.Linear(16, 16), Residual(inplace)),
], ids=["relu", "relu-dropout-chain", "residual"])
def test_in_place_changes_after_a_module_do_not_change_its_statistics(make):
    """Each module's statistics are of the tensor as it returned it: the monitored model modifies
    outputs in place, the reference is the same model computed out of place (no aliasing possible)."""
    torch.manual_seed(0)
    model, twin = make(True), make(False)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(32, model[0].in_features)
    want = brute_force_gap_metrics(twin, lambda: twin(x).square().sum().backward())
    with gapmon.GAPMonitor(model) as mon:
        got = _step(mon, model, x)
    assert_metrics_close(got, want, rtol=1e-5, atol=1e-6)
    if isinstance(model[1], nn.ReLU):  # the figures of the issue: ReLU mean 0.239, not the Linear's 0.023
        relu = twin[1](twin[0](x)).double()
        assert got["gap/activations/1/mean"] == pytest.approx(relu.mean(1).mean().item(), rel=1e-6)
        assert got["gap/activations/1/mean"] != pytest.approx(got["gap/activations/0/mean"], rel=1e-3)


class SlashNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({"enc/0": nn.Linear(4, 4), "dec/a/b": nn.Linear(4, 4)})

    def forward(self, x):
        return self.blocks["dec/a/b"](self.blocks["enc/0"](x))


def test_names_with_slashes_round_trip_and_nan_is_reported(caplog):
    for name in ("blocks.enc/0", "a/b/c", "x/max", "grads/y"):
        for field in ("max", "mean", "nonfinite"):
            assert parse_metric_name(metric_name("activations", name, field)) == ("activations", name, field)
    model = SlashNames()
    x = torch.randn(3, 4)
    x[1, 2] = math.nan
    with gapmon.GAPMonitor(model) as mon, caplog.at_level(logging.WARNING, logger="gapmon"):
        _step(mon, model, x)
    assert mon.nonfinite_report["first_activation"] == "blocks.enc/0"
    assert "blocks.enc/0" in caplog.text


def test_empty_parameter_is_not_a_nonfinite_alarm(caplog):
    model = nn.Linear(4, 4)
    model.register_parameter("empty", nn.Parameter(torch.empty(0, 4)))
    with gapmon.GAPMonitor(model) as mon, caplog.at_level(logging.WARNING, logger="gapmon"):
        metrics = _step(mon, model, torch.randn(3, 4))
    assert mon.nonfinite_report == {} and "non-finite" not in caplog.text
    assert {k: v for k, v in metrics.items() if "/empty/" in k} == {  # no mean or var of no elements
        "gap/params/empty/max": 0.0, "gap/params/empty/norm": 0.0, "gap/params/empty/nonfinite": 0.0}
    assert all(math.isfinite(v) for v in metrics.values())
    assert "gap/params/weight/mean" in metrics


class SparseBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 6, sparse=True)
        self.head = nn.Linear(6, 3)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def test_sparse_gradients_give_the_statistics_of_the_dense_gradient(tmp_path):
    torch.manual_seed(0)
    model = SparseBag()
    ids = torch.tensor([[1, 2, 2, 7], [7, 7, 3, 1], [40, 2, 9, 9]])  # repeated ids: uncoalesced rows
    with gapmon.GAPMonitor(model) as mon, gapmon.GradientDumper(model, tmp_path, async_write=False) as dumper:
        metrics = _step(mon, model, ids)
        assert model.emb.weight.grad.is_sparse
        dumper.maybe_dump(0)
    dense = model.emb.weight.grad.to_dense()
    want = float64_stats(dense)
    for field, key in (("max", "max_abs"), ("mean", "mean"), ("var", "var"), ("norm", "norm"), ("nonfinite", "nonfinite")):
        assert metrics[f"gap/grads/emb.weight/{field}"] == pytest.approx(want[key], rel=1e-6, abs=1e-12), field
    assert torch.equal(gapmon.reconstruct_gradients(tmp_path, 0)["emb.weight"], dense)


def test_complex_parameters_are_refused_when_attaching(tmp_path):
    model = nn.Linear(4, 4)
    model.register_parameter("phase", nn.Parameter(torch.randn(3, dtype=torch.complex64)))
    with pytest.raises(TypeError, match="'phase'.*complex"):
        gapmon.GAPMonitor(model)
    with pytest.raises(TypeError, match="'phase'.*complex"):
        gapmon.GradientDumper(model, tmp_path)
    assert not tmp_path.joinpath("config.json").exists()
    gapmon.GAPMonitor(model, params=False, grads=False).close()  # activations alone are fine


def test_first_step_under_inference_mode_then_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    with gapmon.GAPMonitor(model, grads=False, activation_grads=False) as mon:
        with torch.inference_mode():
            mon.begin_step(0, batch_size=5)
            model(x)
            mon.end_step()
        got = _step(mon, model, x, step=np.int64(1))
    model.zero_grad()
    want = brute_force_gap_metrics(model, lambda: model(x).square().sum().backward())
    assert_metrics_close(got, {k: v for k, v in want.items() if "/grads/" not in k and "/activation_grads/" not in k})


def test_step_types(tmp_path):
    model = nn.Linear(4, 2)
    with gapmon.GAPMonitor(model, sinks=[gapmon.JSONLSink(tmp_path / "m.jsonl")]) as mon:
        _step(mon, model, torch.randn(3, 4), step=np.int64(3))
        for bad, error in ((5.0, TypeError), (True, TypeError), ("7", TypeError), (-1, ValueError)):
            with pytest.raises(error, match="non-negative integer"):
                mon.begin_step(bad)
    assert json.loads((tmp_path / "m.jsonl").read_text())["step"] == 3


def test_a_briefly_full_disk_loses_no_jsonl_line(tmp_path, monkeypatch):
    """Writes fail with ENOSPC after writing half a line, then space returns: every line is whole
    and in order, nothing glued, nothing lost."""
    path = tmp_path / "metrics.jsonl"
    sink = gapmon.JSONLSink(path)
    real_write = os.write
    full = {"on": False}

    def write(fd, data):
        if full["on"]:
            real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr("gapmon.monitor.sinks.os.write", write)
    sink.write(0, {"gap/x": 1.0}, {})
    full["on"] = True
    with pytest.warns(RuntimeWarning, match="cannot write metrics"):
        sink.write(1, {"gap/x": 2.0}, {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per outage
        sink.write(2, {"gap/x": 3.0}, {})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0]  # no partial line
    full["on"] = False
    with pytest.warns(RuntimeWarning, match="writable again"):
        sink.write(3, {"gap/x": 4.0}, {})
    sink.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["gap/x"]) for r in records] == [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0)]


def test_unwritable_lines_raise_at_close(tmp_path, monkeypatch):
    sink = gapmon.JSONLSink(tmp_path / "metrics.jsonl")

    def write(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("gapmon.monitor.sinks.os.write", write)
    with pytest.warns(RuntimeWarning):
        sink.write(0, {"gap/x": 1.0}, {})
    with pytest.raises(OSError, match=r"1 step\(s\) could not be written"):
        sink.close()


def test_report_names_bad_records_and_reads_the_rest(tmp_path):
    pytest.importorskip("matplotlib")
    good = [{"step": s, "gap/grads/w/norm": 1.0 + s, "gap/activations/a/max": 2.0} for s in range(4)]
    lines = [json.dumps(r) for r in good]
    lines.insert(2, '{"step": 9, "gap/grads/w/norm": 1.0{"step": 10')  # two records glued together
    lines.insert(4, "[1, 2]")
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    skipped = []
    report = make_report(tmp_path, skipped)
    assert [s.split(": ")[0] for s in skipped] == [f"{tmp_path / 'metrics.jsonl'}:3", f"{tmp_path / 'metrics.jsonl'}:5"]
    text = report.read_text()
    assert "4 monitored steps (0..3)" in text and "metrics.jsonl:3" in text


def test_sparse_gradients_with_numerics_on_give_the_dense_gradient_numbers():
    """With numerics on, parameters and gradients take the one-pass statistics + numerics op, which
    reads dense tensors only: a sparse gradient takes the separate path, and both its statistics and
    its numerics are those of the dense gradient."""
    torch.manual_seed(0)
    model = SparseBag()
    ids = torch.tensor([[1, 2, 2, 7], [7, 7, 3, 1], [40, 2, 9, 9]])
    with gapmon.GAPMonitor(model, numerics=("bf16",)) as mon:
        metrics = _step(mon, model, ids)
    dense = model.emb.weight.grad.to_dense()
    want = float64_stats(dense)
    assert metrics["gap/grads/emb.weight/norm"] == pytest.approx(want["norm"], rel=1e-6)
    assert metrics["gap/grads/emb.weight/mean"] == pytest.approx(want["mean"], rel=1e-6, abs=1e-12)
    d = dense.double().flatten() - dense.double().mean()
    assert metrics["gap/grads/emb.weight/kurtosis"] == pytest.approx((d.numel() * (d ** 4).sum() / (d ** 2).sum() ** 2).item())
    assert metrics["gap/params/head.weight/norm"] == pytest.approx(model.head.weight.double().norm().item(), rel=1e-6)


def test_report_names_hostile_records_of_every_run_file_and_reads_the_rest(tmp_path):
    """Records that parse as JSON but cannot be used (or cannot be parsed at all without crashing a naive
    reader) are named as file:line and left out; every good record of every file is still reported."""
    pytest.importorskip("matplotlib")
    hist = {"grads/Linear": {"e-3": 5, "zero": 1}}
    metrics = [json.dumps({"step": s, "gap/grads/w/norm": 1.0 + s, "numerics_histograms": hist,
                           "gap/grads/w/bf16_underflow": 0.0}) for s in range(3)]
    bad_metrics = ["[" * 100_000 + "]" * 100_000,  # nested too deeply for Python's json
                   '{"step": ' + "9" * 5000 + "}",  # more digits than Python converts
                   json.dumps({"step": 7, "numerics_histograms": {"grads/Linear": {"e999": 1}}}),  # unknown bin
                   json.dumps({"step": 8, "numerics_histograms": {"grads/Linear": {"e-3": -1}}}),  # negative count
                   json.dumps({"step": True}),  # a bool is not a step
                   json.dumps({"step": 6, "numerics_scaled": {"grads/Linear": {"bf16": {"underflow": "x"}}}})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(metrics + bad_metrics) + "\n")
    train = [json.dumps({"step": s, "loss": 2.0 - s / 10}) for s in range(3)] + [json.dumps({"step": 3, "loss": "low"})]
    (tmp_path / "train.jsonl").write_text("\n".join(train) + "\n")
    per_sample = [json.dumps({"step": 0, "ids": [0, 1], "norms": [1.0, 2.0]}), json.dumps({"step": 1, "norms": 3.0}),
                  json.dumps({"step": 2, "ids": ["a"], "norms": [1.0]})]
    (tmp_path / "per_sample_norms.jsonl").write_text("\n".join(per_sample) + "\n")
    skipped = []
    text = make_report(tmp_path, skipped).read_text()
    named = sorted(line.split(": ")[0].rsplit("/", 1)[1] for line in skipped)
    assert named == sorted([f"metrics.jsonl:{n}" for n in range(4, 10)] + ["train.jsonl:4", "per_sample_norms.jsonl:2",
                                                                            "per_sample_norms.jsonl:3"]), skipped
    assert "3 monitored steps (0..2)" in text
    assert "Loss: 2.0000 at step 0 -> 1.8000 at step 2" in text


def test_the_report_writes_nothing_through_a_planted_link(tmp_path):
    pytest.importorskip("matplotlib")
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "gap/grads/w/norm": 1.0}) + "\n")
    victim = outside / "victim.png"
    victim.write_bytes(b"keep")
    (run / "report").mkdir()
    (run / "report" / "grad_norm_heatmap.png").symlink_to(victim)  # a file link: replaced, not written through
    make_report(run)
    assert victim.read_bytes() == b"keep" and not (run / "report" / "grad_norm_heatmap.png").is_symlink()
    shutil.rmtree(run / "report")
    (run / "report").symlink_to(outside, target_is_directory=True)  # a directory link: refused
    with pytest.raises(OSError, match="symbolic link"):
        make_report(run)
    assert sorted(p.name for p in outside.iterdir()) == ["victim.png"]
