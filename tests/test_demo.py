"""`gapmon demo` end to end, `gapmon report`, and one-line CLI errors."""
import json
import math
import subprocess
import sys

import pytest

from gapmon.apps.report import anomalies, make_report


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "gapmon", *map(str, args)], capture_output=True, text=True, cwd=cwd)


@pytest.mark.multiprocess
def test_demo_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = _cli("demo", "--nproc", 2, "--steps", 3, "--dump-every", 2, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "monitor cost" in proc.stdout and str(out / "report" / "report.md") in proc.stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for key in ("gap/params/head.weight/var", "gap/grads/blocks.0.mlp.up.weight/norm",
                "gap/activations/blocks.1.attn/max", "gap/activation_grads/blocks.0.norm1/mean",
                "gap/per_sample_grad_norm/mean", "gap/global_batch_size"):
        assert key in metrics[-1], key
    assert metrics[-1]["gap/global_batch_size"] == 16
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dumped_steps"] == [0, 2] and summary["reconstructed_step"] == 2
    # The reconstructed gradients are the ones the monitor measured at that step.
    meta = json.loads((out / "reconstructed" / "step2_metadata.json").read_text())
    for name, norm in meta["parameter_norms"].items():
        assert math.isclose(norm, metrics[2][f"gap/grads/{name}/norm"], rel_tol=1e-5), name
    for png in ("grad_norm_heatmap.png", "activation_max.png", "loss_grad_norm.png", "per_sample_norms.png"):
        assert (out / "report" / png).stat().st_size > 1000, png
    per_sample = [json.loads(line) for line in (out / "per_sample_norms.jsonl").read_text().splitlines()]
    assert len(per_sample[0]["ids"]) == 16 and per_sample[0]["ids"] == sorted(per_sample[0]["ids"])


def test_report_flags_anomalies(tmp_path):
    records = []
    for step in range(6):
        records.append({"step": step, "gap/grads/w/norm": 1.0 if step != 4 else 50.0, "gap/grads/w/nonfinite": 0.0,
                        "gap/activations/layer/max": 2.0 + step, "gap/activations/layer/nonfinite": 3.0 if step == 5 else 0.0})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    found = anomalies(records)
    assert (4, "grads/w", "norm 50 = 50x its median") in found
    assert (5, "activations/layer", "3 non-finite values") in found
    path = make_report(tmp_path)
    text = path.read_text()
    assert "| 4 | grads/w |" in text and "grad_norm_heatmap.png" in text
    assert (tmp_path / "report" / "activation_max.png").exists()


def test_cli_errors_are_one_line(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    for args, needle in ((("demo", "--out", tmp_path / "busy"), "not empty"),
                         (("report", tmp_path / "nothing"), "metrics.jsonl"),
                         (("demo", "--nproc", 0, "--out", tmp_path / "new"), "positive"),
                         (("steps", tmp_path / "nothing"), "does not exist")):
        proc = _cli(*args)
        assert proc.returncode != 0, args
        assert proc.stderr.count("\n") == 1 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_info_reports_backend_and_cuda_kernels():
    import gapmon

    proc = _cli("info")
    assert proc.returncode == 0, proc.stderr
    assert f"gapmon backend: {gapmon.backend()}" in proc.stdout
    assert ("CUDA kernels: compiled in" if gapmon.ops.cuda_kernels_compiled() else "CUDA kernels: not compiled in") in proc.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_demo_on_cuda_without_gpu_is_one_line_error(tmp_path):
    proc = _cli("demo", "--device", "cuda", "--out", tmp_path / "gpu")
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and "CUDA" in proc.stderr, proc.stderr
