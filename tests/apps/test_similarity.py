"""`gapmon similarity` and the report's similarity heat maps read what PerSampleGradients collected."""
import json

import torch
import torch.nn as nn

import gapmon
from gapmon.apps.cli import main
from gapmon.apps.report import make_report
from gapmon.per_sample import PerSampleGradients


def _collect(run_dir):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    sink = gapmon.JSONLSink(run_dir / "metrics.jsonl")
    with PerSampleGradients(model, run_dir / "per_sample_gradients", layers=("0", "2"), chunk=4) as coll, \
            gapmon.GAPMonitor(model, sinks=[sink]) as mon:
        for step in range(2):
            coll.begin_step(step)
            mon.begin_step(step, batch_size=6)
            model(x).square().mean().backward()
            mon.end_step()
            coll.end_step()
            model.zero_grad()
    sink.close()
    return model, x


def test_similarity_cli_prints_the_matrix_and_plots(tmp_path, capsys):
    model, x = _collect(tmp_path)
    assert main(["similarity", str(tmp_path), "--layer", "0", "--plot", str(tmp_path / "sim.png")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("step 1, layer 0: cosine similarity of 6 samples")
    rows = [list(map(float, line.split()[1:])) for line in lines[2:8]]
    grads = []
    for i in range(6):
        w, b = torch.autograd.grad(model(x[i:i + 1]).square().mean(), [model[0].weight, model[0].bias])
        grads.append(torch.cat([w.reshape(-1), b]))
    g = torch.stack(grads)
    cos = (g @ g.T) / (g.norm(dim=1)[:, None] * g.norm(dim=1)[None, :])
    assert torch.allclose(torch.tensor(rows, dtype=torch.float64), cos, atol=6e-4)  # printed to 3 decimals
    assert (tmp_path / "sim.png").stat().st_size > 1000
    assert main(["similarity", str(tmp_path), "--layer", "nope"]) == 1
    assert "no layer 'nope' collected at step 1; collected: 0, 2" in capsys.readouterr().err


def test_report_shows_the_last_collected_step(tmp_path):
    _collect(tmp_path)
    report = make_report(tmp_path).read_text()
    assert "Per-sample gradient similarity, 0 (step 1)" in report
    assert (tmp_path / "report" / "similarity_0.png").stat().st_size > 1000  # layer "0", the first collected
    assert "![Per-sample gradient similarity, 2 (step 1)](similarity_1.png)" in report
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
