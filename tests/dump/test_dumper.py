"""GradientDumper and reconstruction on one process: round trips, schedule, validation, refusal of
incomplete or corrupt dumps, crash and full-disk safety, the CLI and the analysis helpers."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

import gapmon
from gapmon.apps.examples import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from gapmon.dump.reconstruct import DumpError, list_steps, reconstruct_gradients

CFG = GPTConfig(vocab_size=37, seq_len=8, d_model=24, n_heads=2, n_layers=2)


def _model_with_grads(step=0):
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    x, y = synthetic_batch(CFG, 4, step)
    lm_loss(model(x), y).backward()
    return model


def _expected(model, first_n=None):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = g if first_n is None else g[tuple(slice(0, first_n) for _ in g.shape)]
    return out


@pytest.mark.parametrize("mode, kwargs", [("shards", {}), ("full", {}), ("sampled", {"save_first_n": 5})])
@pytest.mark.parametrize("async_write", [False, True])
def test_round_trip(tmp_path, mode, kwargs, async_write):
    model = _model_with_grads()
    with gapmon.GradientDumper(model, tmp_path, mode=mode, async_write=async_write, **kwargs) as dumper:
        assert dumper.maybe_dump(0)
    got = reconstruct_gradients(tmp_path, 0)
    want = _expected(model, kwargs.get("save_first_n"))
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["parallel_type"] == "single" and config["world_size"] == 1 and config["mode"] == mode


def test_async_and_sync_files_identical(tmp_path):
    model = _model_with_grads()
    files = []
    for sub, async_write in (("sync", False), ("async", True)):
        with gapmon.GradientDumper(model, tmp_path / sub, async_write=async_write) as dumper:
            dumper.maybe_dump(0)
        data = (tmp_path / sub / "step0" / "rank0.safetensors").read_bytes()
        assert data.count(dumper.run_id.encode()) == 2  # the run id, and the dump's generation id
        files.append(data.replace(dumper.run_id.encode(), b"0" * len(dumper.run_id)))  # each dumper's own id
    assert files[0] == files[1]


@pytest.mark.parametrize("mode", ["shards", "full"])
def test_async_copies_before_returning(tmp_path, mode):
    """The optimizer may change gradients right after maybe_dump: the dump holds the values at the call."""
    model = _model_with_grads()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    with gapmon.GradientDumper(model, tmp_path, mode=mode, async_write=True) as dumper:
        dumper.maybe_dump(0)
        for p in model.parameters():
            p.grad.mul_(3)
        dumper.maybe_dump(1)
    for step, factor in ((0, 1), (1, 3)):
        got = reconstruct_gradients(tmp_path, step)
        assert all(torch.equal(got[n], want[n] * factor) for n in want), step


def test_schedule(tmp_path):
    model = _model_with_grads()
    with gapmon.GradientDumper(model, tmp_path, start_step=2, step_interval=3, end_step=8) as dumper:
        done = [s for s in range(12) if dumper.maybe_dump(s)]
    assert done == [2, 5, 8]
    assert list_steps(tmp_path) == ([2, 5, 8], [])


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(start_step=-1), "start_step"),
        (dict(step_interval=0), "step_interval"),
        (dict(mode="sampled"), "save_first_n"),
        (dict(mode="sampled", save_first_n=0), "save_first_n"),
        (dict(mode="shards", save_first_n=4), "save_first_n"),
        (dict(mode="everything"), "mode"),
        (dict(start_step=5, end_step=2), "end_step"),
    ],
)
def test_arguments_validated(tmp_path, kwargs, error):
    with pytest.raises(ValueError, match=error):
        gapmon.GradientDumper(_model_with_grads(), tmp_path, **kwargs)


def test_incomplete_missing_and_corrupt_are_refused(tmp_path):
    model = _model_with_grads()
    with gapmon.GradientDumper(model, tmp_path, async_write=False) as dumper:
        for step in range(3):
            dumper.maybe_dump(step)
    (tmp_path / "step0" / "COMPLETE").unlink()
    with pytest.raises(DumpError, match="step 0 is incomplete"):
        reconstruct_gradients(tmp_path, 0)
    (tmp_path / "step1" / "rank0.safetensors").unlink()
    with pytest.raises(DumpError, match="rank0.safetensors"):
        reconstruct_gradients(tmp_path, 1)
    path = tmp_path / "step2" / "rank0.safetensors"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(DumpError, match="corrupt"):
        reconstruct_gradients(tmp_path, 2)
    with pytest.raises(DumpError, match="not dumped"):
        reconstruct_gradients(tmp_path, 7)
    with pytest.raises(DumpError, match="config.json"):
        reconstruct_gradients(tmp_path / "step1", 1)


# Shared start of the subprocess scripts: a model with gradients.
_SCRIPT_SETUP = """
import os, resource, signal, torch, safetensors.torch as st
import gapmon
from gapmon.apps.examples import GPTConfig, TinyGPT, lm_loss, synthetic_batch
cfg = GPTConfig(vocab_size=37, seq_len=8, d_model=24, n_heads=2, n_layers=2)
model = TinyGPT(cfg); x, y = synthetic_batch(cfg, 4, 0); lm_loss(model(x), y).backward()
"""


def _run_script(code: str, cwd) -> subprocess.CompletedProcess:
    script = _SCRIPT_SETUP + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd)


def test_killed_during_write_leaves_no_complete_step(tmp_path):
    code = f"""
        dumper = gapmon.GradientDumper(model, {str(tmp_path)!r}, async_write=False)
        dumper.maybe_dump(0)
        real = st.save_file
        def dying(tensors, path, metadata=None):
            with open(path, "wb") as f:
                f.write(b"half a file")
            os._exit(9)  # killed in the middle of writing step 1
        st.save_file = dying
        dumper.maybe_dump(1)
    """
    proc = _run_script(code, tmp_path)
    assert proc.returncode == 9, proc.stderr
    assert list_steps(tmp_path) == ([0], [1])
    assert not (tmp_path / "step1" / "rank0.safetensors").exists()
    with pytest.raises(DumpError, match="incomplete"):
        reconstruct_gradients(tmp_path, 1)
    reconstruct_gradients(tmp_path, 0)  # the earlier step is intact


def test_full_disk_raises_clearly_and_keeps_earlier_steps(tmp_path):
    code = f"""
        dumper = gapmon.GradientDumper(model, {str(tmp_path)!r}, async_write=True)
        dumper.maybe_dump(0)
        dumper._wait()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # no room for another step file
        try:
            dumper.maybe_dump(1)
            dumper.close()
        except OSError as e:
            print("ERROR:", e)
    """
    proc = _run_script(code, tmp_path)
    assert "ERROR: " in proc.stdout and "earlier steps are intact" in proc.stdout, proc.stdout + proc.stderr
    assert list_steps(tmp_path)[0] == [0]
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "step1").iterdir())
    reconstruct_gradients(tmp_path, 0)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "gapmon", *map(str, args)], capture_output=True, text=True)


def test_cli_reconstruct_outputs(tmp_path):
    model = _model_with_grads()
    with gapmon.GradientDumper(model, tmp_path / "g") as dumper:
        dumper.maybe_dump(4)
    out = tmp_path / "out"
    proc = _cli("reconstruct", tmp_path / "g", out, "--step", 4, "--format", "pt", "--quiet")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "step4_metadata.json").read_text())
    assert set(meta) == {"step", "parallel_type", "world_size", "parameters", "parameter_norms"}
    head = meta["parameters"]["head.weight"]
    g = model.head.weight.grad
    assert head["shape"] == list(g.shape) and head["dtype"] == "float32"
    assert head["norm"] == pytest.approx(g.norm().item(), rel=1e-5)
    assert head["max_abs"] == pytest.approx(g.abs().max().item(), rel=1e-6)
    assert head["var"] == pytest.approx(g.var().item(), rel=1e-5)
    assert torch.equal(load_file(out / "step4_head.weight.safetensors")["head.weight"], g)
    assert torch.equal(torch.load(out / "step4_all_gradients.pt", weights_only=True)["tok.weight"], model.tok.weight.grad)
    proc = _cli("reconstruct", tmp_path / "g", tmp_path / "only", "--step", 4, "--skip-individual", "--quiet")
    # (the step's pointer and its generation directory are hidden entries: see gapmon.export)
    assert sorted(p.name for p in (tmp_path / "only").iterdir() if not p.name.startswith(".")) == ["step4_all_gradients.safetensors",
                                                                       "step4_metadata.json"]


def test_cli_errors_are_one_line_and_write_nothing(tmp_path):
    model = _model_with_grads()
    with gapmon.GradientDumper(model, tmp_path / "g") as dumper:
        dumper.maybe_dump(0)
    (tmp_path / "g" / "step0" / "COMPLETE").unlink()
    proc = _cli("reconstruct", tmp_path / "g", tmp_path / "out", "--step", 0)
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "incomplete" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    steps = _cli("steps", tmp_path / "g")
    assert "incomplete: 0" in steps.stdout


def test_analysis(tmp_path):
    model = _model_with_grads()
    with gapmon.GradientDumper(model, tmp_path / "g", async_write=False) as dumper:
        for step in range(3):
            for p in model.parameters():
                p.grad.mul_(2.0)
            dumper.maybe_dump(step)
    evo = gapmon.analysis.norm_evolution(tmp_path / "g")
    norms = [n for _, n in evo["head.weight"]]
    assert norms[1] == pytest.approx(2 * norms[0], rel=1e-6) and len(norms) == 3
    grads = reconstruct_gradients(tmp_path / "g", 0)
    grads["head.weight"][0, 0] = float("nan")
    grads["tok.weight"].mul_(1e9)
    kinds = {a.name: a.kind for a in gapmon.analysis.anomaly_scan(grads)}
    assert kinds["head.weight"] == "nonfinite" and kinds["tok.weight"] == "large_norm"
    a, b = reconstruct_gradients(tmp_path / "g", 0), reconstruct_gradients(tmp_path / "g", 1)
    rows = {r.name: r for r in gapmon.analysis.compare(b, a)}
    assert rows["head.weight"].rel_diff == pytest.approx(1.0, rel=1e-6)
    assert rows["head.weight"].cosine == pytest.approx(1.0, rel=1e-6)


def test_async_staging_reuse_keeps_each_step(tmp_path):
    """Consecutive async dumps reuse two staging sets: every step must still hold its own values."""
    model = _model_with_grads()
    want = {}
    with gapmon.GradientDumper(model, tmp_path, async_write=True) as dumper:
        for step in range(5):
            for p in model.parameters():
                p.grad.add_(1.0)
            want[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
            dumper.maybe_dump(step)
    for step, grads in want.items():
        got = reconstruct_gradients(tmp_path, step)
        assert all(torch.equal(got[n], grads[n]) for n in grads), step
