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
    cost = next(line for line in proc.stdout.splitlines() if "monitor cost" in line)
    # The figure says what it measures: which monitoring, paired how, on which model.
    assert "four kinds " in cost and "four kinds + per-sample norms " in cost
    assert "median of 3 paired steps" in cost and "2 layers, d=128" in cost
    assert str(out / "report" / "report.md") in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # 3 training steps, then 3 timing groups (plain, four kinds, + per-sample norms): the sink's monitor is the last.
    # Each monitored step writes its metrics, then those of the optimizer's update (gap/update/...).
    assert [m["step"] for m in records] == [s for s in (0, 1, 2, 5, 8, 11) for _ in range(2)]
    assert all(all(k.startswith("gap/update/") for k in m if k != "step") for m in records[1::2])
    metrics = [{**a, **b} for a, b in zip(records[0::2], records[1::2])]
    for key in ("gap/params/head.weight/var", "gap/grads/blocks.0.mlp.up.weight/norm",
                "gap/activations/blocks.1.attn/max", "gap/activation_grads/blocks.0.norm1/mean",
                "gap/per_sample_grad_norm/mean", "gap/global_batch_size", "gap/gns/all/b_simple",
                "gap/gns/Linear/noise_trace", "gap/update/head.weight/ratio", "gap/update/head.weight/exp_avg_sq_norm"):
        assert key in metrics[-1], key
    assert metrics[-1]["gap/global_batch_size"] == 16
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dumped_steps"] == [0, 2] and summary["reconstructed_step"] == 2
    # One final loss: the summary's and the report's are the same step's.
    assert f"-> {summary['loss_last']:.4f} at step 11" in (out / "report" / "report.md").read_text()
    assert set(summary["monitor_overhead"]) == {"four kinds", "four kinds + per-sample norms + numerics + block formats + updates"}
    # The reconstructed gradients are the ones the monitor measured at that step.
    meta = json.loads((out / "reconstructed" / "step2_metadata.json").read_text())
    for name, norm in meta["parameter_norms"].items():
        assert math.isclose(norm, metrics[2][f"gap/grads/{name}/norm"], rel_tol=1e-5), name
    # numerics on: per-tensor shares, histograms per kind and layer type, the report's figure
    assert "gap/grads/head.weight/fp8_e4m3_underflow" in metrics[-1] and "grads/Linear" in metrics[-1]["numerics_histograms"]
    assert "## Low-precision numerics" in (out / "report" / "report.md").read_text()
    # per-block formats on: per tensor and format, and the report's figure and table
    assert 0 < metrics[-1]["gap/grads/head.weight/mxfp8_e4m3_sqnr_db"] < 100
    assert "gap/params/head.weight/nvfp4_block_underflow" in metrics[-1]
    assert "| grads nvfp4 |" in (out / "report" / "report.md").read_text()
    for png in ("grad_norm_heatmap.png", "activation_max.png", "loss_grad_norm.png", "per_sample_norms.png", "numerics.png",
                "noise_scale.png", "update_ratio_heatmap.png", "block_formats.png"):
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


def test_global_flags_before_the_subcommand():
    proc = _cli("--verbose", "info")
    assert proc.returncode == 0 and "gapmon backend" in proc.stdout, proc.stderr


def test_hsdp_with_odd_processes_fails_before_spawning(tmp_path):
    out = tmp_path / "hsdp"
    proc = _cli("demo", "--nproc", 3, "--hsdp", "--out", out)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and "even number" in proc.stderr, proc.stderr
    assert not out.exists()  # validated before anything was created


@pytest.mark.multiprocess
@pytest.mark.parametrize("moment", ["importing", "workers starting", "training"])
def test_ctrl_c_at_any_moment_of_the_demo_is_one_line(tmp_path, moment):
    """Ctrl-C (SIGINT to the whole process group) while the console script imports torch, while
    the workers start, and while they train: one line, exit code 130, no traceback."""
    import os
    import signal
    import time

    out = tmp_path / "run"
    console_script = "import sys, gapmon_launcher; sys.exit(gapmon_launcher.main())"  # what `gapmon` runs
    # As a terminal starts a program: SIGINT at its default action, even if this test runs where it is
    # ignored (a shell's background job), which the demo would inherit.
    proc = subprocess.Popen([sys.executable, "-c", console_script, "demo", "--out", str(out), "--steps", "500"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    ready = {"importing": lambda: True,
             "workers starting": lambda: (out / ".gapmon-demo").exists(),
             "training": lambda: (out / "train.jsonl").exists() and (out / "train.jsonl").stat().st_size > 0}[moment]
    deadline = time.monotonic() + 120
    time.sleep(0.3)
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C does: the whole process group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err in ("gapmon demo: interrupted\n", "gapmon: interrupted\n"), err[-2000:]


@pytest.mark.multiprocess
def test_a_failing_worker_is_one_line_and_stops_the_others(tmp_path):
    from gapmon.apps.demo import DemoConfig, WorkerError, _spawn

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(WorkerError, match=r"^rank \d: NotADirectoryError: .*a-file"):
        _spawn(DemoConfig(nproc=2, steps=2, out=str(blocker), quiet=True))


def test_a_demo_directory_can_be_run_again_and_others_are_refused(tmp_path):
    from gapmon.apps.demo import MARKER, _prepare_run_dir

    run = tmp_path / "run"
    _prepare_run_dir(run)
    (run / "gradients" / "step0").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}")
    _prepare_run_dir(run)  # an earlier (here: interrupted) demo's directory is replaced
    assert sorted(p.name for p in run.iterdir()) == [MARKER]
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a gapmon demo's"):
        _prepare_run_dir(other)
    assert (other / "notes.txt").read_text() == "keep"


def test_steps_refuses_a_folder_that_is_not_a_dump(tmp_path):
    proc = _cli("steps", tmp_path)
    assert proc.returncode != 0 and "config.json is missing" in proc.stderr, proc.stderr


def test_empty_dump_reconstructs_to_a_clear_error(tmp_path):
    code = ("import torch, gapmon, warnings; warnings.simplefilter('ignore'); m = torch.nn.Linear(2, 2);"
            f"d = gapmon.GradientDumper(m, {str(tmp_path / 'x')!r}, step_interval=1); d.maybe_dump(0); d.close()")
    subprocess.run([sys.executable, "-c", code], check=True)
    proc = _cli("reconstruct", tmp_path / "x", tmp_path / "xo", "--step", 0)
    assert proc.returncode != 0 and "holds no gradients" in proc.stderr, proc.stderr


def test_compare_reads_the_pt_files_reconstruct_writes(tmp_path):
    code = ("import torch, gapmon; m = torch.nn.Linear(3, 2); m(torch.ones(4, 3)).sum().backward();"
            f"d = gapmon.GradientDumper(m, {str(tmp_path / 'g')!r}, async_write=False); d.maybe_dump(0); d.close()")
    subprocess.run([sys.executable, "-c", code], check=True)
    proc = _cli("reconstruct", tmp_path / "g", tmp_path / "r", "--step", 0, "--format", "pt", "--verify")
    assert proc.returncode == 0 and "checksums of 1 file verified; one replica" in proc.stdout, proc.stderr + proc.stdout
    pt = tmp_path / "r" / "step0_all_gradients.pt"
    proc = _cli("compare", pt, tmp_path / "r" / "step0_all_gradients.safetensors")
    assert proc.returncode == 0 and "weight" in proc.stdout and "1.00000" in proc.stdout, proc.stderr


def test_isolated_build_stops_at_once_with_one_line(tmp_path):
    """setup.py without an importable torch (what an isolated pip build sees) names the fix."""
    from pathlib import Path

    setup = Path(__file__).resolve().parents[2] / "setup.py"
    code = f"import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; exec(open({str(setup)!r}).read())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode != 0 and "--no-build-isolation" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.multiprocess
def test_workers_end_when_the_demo_is_killed_outright(tmp_path):
    """The workers run in sessions of their own (out of the terminal's reach): a parent killed with
    SIGKILL must not leave them running (PR_SET_PDEATHSIG sends them SIGTERM)."""
    import os
    import signal
    import time

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "gapmon", "demo", "--out", str(out), "--steps", "500"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not ((out / "train.jsonl").exists() and (out / "train.jsonl").stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while any(running(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [w for w in workers if running(w)]
    for w in left:
        os.kill(int(w), signal.SIGKILL)
    assert not left, f"workers {left} outlived their killed parent"
