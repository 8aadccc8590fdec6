"""Dumps are never mixed, lost or silently corrupt (issue 21, items 7-16): dump generations,
re-dumps and resumed runs, integer steps, checksums, reader gaps, leftovers, dead ranks, DCP errors."""
import json
import os
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import torch.nn as nn
from helpers import reseal_complete
from safetensors.torch import save_file

import gapmon
from gapmon.dump.export import write_reconstruction
from gapmon.dump.reconstruct import DumpError, list_steps, reconstruct_gradients


def _model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    model(torch.randn(5, 4)).square().sum().backward()
    return model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_equal(got, want):
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _complete(path, step):
    return json.loads((path / f"step{step}" / "COMPLETE").read_text())


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "gapmon", *map(str, args)], capture_output=True, text=True)


MODES = [("shards", {}), ("full", {}), ("sampled", {"save_first_n": 100})]


@pytest.mark.parametrize("async_write", [False, True])
@pytest.mark.parametrize("mode, kwargs", MODES, ids=[m for m, _ in MODES])
def test_a_step_dumped_again_is_replaced_by_the_new_dump(tmp_path, mode, kwargs, async_write):
    model = _model()
    with gapmon.GradientDumper(model, tmp_path, mode=mode, async_write=async_write, **kwargs) as dumper:
        dumper.maybe_dump(3)
        for p in model.parameters():
            p.grad.mul_(-2.0)
        dumper.maybe_dump(3)  # full mode: "Directory not empty" before
    _assert_equal(reconstruct_gradients(tmp_path, 3), _grads(model))
    record = _complete(tmp_path, 3)
    assert record["generation"] == f"{dumper.run_id}.3.1" and record["config"]["mode"] == mode


def test_complete_vouches_for_one_generation_only(tmp_path):
    """A re-dump's file beside the COMPLETE of the earlier dump (the instant between a rank's new
    file and rank 0's new COMPLETE) is refused: one step never mixes two dumps."""
    model = _model()
    dumper = gapmon.GradientDumper(model, tmp_path / "d", async_write=False)
    dumper.maybe_dump(0)
    earlier = (tmp_path / "d" / "step0" / "COMPLETE").read_text()
    for p in model.parameters():
        p.grad.add_(1.0)
    dumper.maybe_dump(0)
    dumper.close()
    (tmp_path / "d" / "step0" / "COMPLETE").write_text(earlier)
    with pytest.raises(DumpError, match="mixes two dumps"):
        reconstruct_gradients(tmp_path / "d", 0)


def test_a_resumed_run_in_another_mode_keeps_every_step_readable(tmp_path):
    first, second = _model(0), _model(1)
    with gapmon.GradientDumper(first, tmp_path, async_write=False) as dumper:
        dumper.maybe_dump(0)
        dumper.maybe_dump(1)
    with gapmon.GradientDumper(second, tmp_path, mode="full", async_write=False) as dumper:
        dumper.maybe_dump(1)  # the resumed run redoes step 1
        dumper.maybe_dump(2)
    assert json.loads((tmp_path / "config.json").read_text())["mode"] == "full"
    assert list_steps(tmp_path) == ([0, 1, 2], [])
    _assert_equal(reconstruct_gradients(tmp_path, 0), _grads(first))  # shards, as its COMPLETE says
    _assert_equal(reconstruct_gradients(tmp_path, 1), _grads(second))
    _assert_equal(reconstruct_gradients(tmp_path, 2), _grads(second))
    assert not (tmp_path / "step1" / "rank0.safetensors").exists()  # the earlier dump's file is gone


def test_steps_are_non_negative_integers(tmp_path):
    model = _model()
    with gapmon.GradientDumper(model, tmp_path, async_write=True) as dumper:
        for bad, error in ((5.0, TypeError), ("5", TypeError), (True, TypeError), (-1, ValueError)):
            with pytest.raises(error, match="non-negative integer"):
                dumper.maybe_dump(bad)
        assert dumper.maybe_dump(np.int64(4))  # async: validated and written, not lost at close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step4"]
    (tmp_path / "step007").mkdir()
    assert list_steps(tmp_path) == ([4], [])  # step007 is not step 7: reconstruct could not find it
    _assert_equal(reconstruct_gradients(tmp_path, np.int64(4)), _grads(model))


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("mode, kwargs", MODES, ids=[m for m, _ in MODES])
@pytest.mark.parametrize("where", ["data", "header", "truncated"])
def test_a_flipped_bit_is_refused(tmp_path, mode, kwargs, where):
    with gapmon.GradientDumper(_model(), tmp_path, mode=mode, async_write=False, **kwargs) as dumper:
        dumper.maybe_dump(0)
    step = tmp_path / "step0"
    files = [p for p in step.rglob("*.safetensors")]
    path = max(files, key=lambda p: p.stat().st_size)
    size = int.from_bytes(path.read_bytes()[:8], "little")
    if where == "data":
        _flip(path, path.stat().st_size - 3)  # inside the last tensor's bytes
    elif where == "header":
        _flip(path, 8 + size - 2)  # inside the header (its padding or JSON)
    else:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 4)
    with pytest.raises(DumpError, match="corrupt|truncated"):
        reconstruct_gradients(tmp_path, 0)
    proc = _cli("reconstruct", tmp_path, tmp_path / "out", "--step", 0)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_verify_means_something_with_one_replica(tmp_path):
    with gapmon.GradientDumper(_model(), tmp_path, async_write=False) as dumper:
        dumper.maybe_dump(0)
    proc = _cli("reconstruct", tmp_path, tmp_path / "out", "--step", 0, "--verify")
    assert proc.returncode == 0 and "checksums of 1 file verified" in proc.stdout, proc.stdout + proc.stderr
    # A step without checksums (format 1) reads, but cannot be verified.
    record = _complete(tmp_path, 0)
    v1 = {"files": ["rank0.safetensors"], "format_version": 1, "run_id": record["run_id"], "step": 0, "world_size": 1}
    (tmp_path / "step0" / "COMPLETE").write_text(json.dumps(v1))
    reconstruct_gradients(tmp_path, 0)
    with pytest.raises(DumpError, match="cannot be verified"):
        reconstruct_gradients(tmp_path, 0, verify=True)


def test_full_index_that_leaves_out_a_parameter_is_refused(tmp_path):
    with gapmon.GradientDumper(_model(), tmp_path, mode="full", async_write=False) as dumper:
        dumper.maybe_dump(0)
    index_path = tmp_path / "step0" / "full_index.json"
    index = json.loads(index_path.read_text())
    del index["0.bias"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(DumpError, match="full_index.json is corrupt"):
        reconstruct_gradients(tmp_path, 0)  # the checksum first
    reseal_complete(tmp_path / "step0")
    with pytest.raises(DumpError, match=r"disagree.*only in the checkpoint: \['0.bias'\]"):
        reconstruct_gradients(tmp_path, 0)


def test_sampled_file_of_another_step_is_refused(tmp_path):
    with gapmon.GradientDumper(_model(), tmp_path, mode="sampled", save_first_n=2, async_write=False) as dumper:
        dumper.maybe_dump(0)
        dumper.maybe_dump(1)
    (tmp_path / "step1" / "sampled.safetensors").write_bytes((tmp_path / "step0" / "sampled.safetensors").read_bytes())
    with pytest.raises(DumpError, match="holds step 0, not step 1"):
        reconstruct_gradients(tmp_path, 1)


def test_a_step_missing_a_file_is_listed_incomplete(tmp_path):
    with gapmon.GradientDumper(_model(), tmp_path, async_write=False) as dumper:
        dumper.maybe_dump(0)
        dumper.maybe_dump(1)
    (tmp_path / "step1" / "rank0.safetensors").unlink()
    assert list_steps(tmp_path) == ([0], [1])
    assert "incomplete: 1" in _cli("steps", tmp_path).stdout


def test_compare_lists_parameters_only_one_side_has(tmp_path):
    save_file({"a": torch.ones(3), "b": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    save_file({"a": torch.ones(3) * 2, "c": torch.ones(2)}, str(tmp_path / "y.safetensors"))
    proc = _cli("compare", tmp_path / "x.safetensors", tmp_path / "y.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "only in A (1): b" in proc.stdout and "only in B (1): c" in proc.stdout


def test_temp_files_of_a_dead_writer_are_removed_at_once(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = os.uname().nodename
    (tmp_path / "step2").mkdir(parents=True)
    orphan = tmp_path / "step2" / f".rank0.safetensors.@{host}@{dead.pid}@.x1.tmp"
    live = tmp_path / "step2" / f".rank1.safetensors.@{host}@{os.getpid()}@.x2.tmp"
    for p in (orphan, live):
        p.write_bytes(b"partial")
    gapmon.GradientDumper(nn.Linear(2, 2), tmp_path, timeout=600).close()
    assert not orphan.exists() and live.exists()


def test_reconstruct_output_is_all_or_nothing_and_follows_the_umask(tmp_path):
    grads = _grads(_model())
    out = tmp_path / "out"
    (out / "step0_metadata.json").mkdir(parents=True)  # a target name taken by a directory
    (out / "step0_all_gradients.safetensors").write_bytes(b"old")
    with pytest.raises(DumpError, match="not a file"):
        write_reconstruction(grads, out, 0, {})
    assert sorted(p.name for p in out.iterdir()) == ["step0_all_gradients.safetensors", "step0_metadata.json"]
    assert (out / "step0_all_gradients.safetensors").read_bytes() == b"old"
    (out / "step0_metadata.json").rmdir()
    files = write_reconstruction(grads, out, 0, {})
    mask = os.umask(0)
    os.umask(mask)
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o666 & ~mask}


def test_bad_header_fields_name_the_file_and_field(tmp_path):
    from safetensors import safe_open

    with gapmon.GradientDumper(_model(), tmp_path, async_write=False) as dumper:
        dumper.maybe_dump(0)
    path = tmp_path / "step0" / "rank0.safetensors"
    with safe_open(str(path), "pt") as f:
        header = json.loads(f.metadata()["gapmon"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for change, match in ((lambda h, t: h["tensors"]["0.weight"].update(offsets=["0", "0"]), "'0.weight'.*'offsets'"),
                          (lambda h, t: h["tensors"]["2.bias"].update(global_shape="3"), "'2.bias'.*'global_shape'"),
                          (lambda h, t: t.pop("0.bias"), "lists tensor.*'0.bias'.*does not hold")):
        h, t = json.loads(json.dumps(header)), dict(tensors)
        change(h, t)
        save_file(t, str(path), metadata={"gapmon": json.dumps(h)})
        reseal_complete(path.parent)
        with pytest.raises(DumpError, match=f"rank0.safetensors.*{match}"):
            reconstruct_gradients(tmp_path, 0)


def _run_script(code: str, cwd) -> subprocess.CompletedProcess:
    prelude = "import os, resource, signal, sys, time, torch, torch.nn as nn, gapmon\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_full_mode_errors_are_one_line(tmp_path):
    code = f"""
        torch.manual_seed(0)
        model = nn.Linear(64, 64)
        model(torch.randn(2, 64)).sum().backward()
        dumper = gapmon.GradientDumper(model, {str(tmp_path)!r}, mode="full", async_write=False)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # DCP's file cannot be written
        try:
            dumper.maybe_dump(1)
        except Exception as e:
            print("ERROR:", e)
    """
    proc = _run_script(code, tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ERROR:")]
    assert len(lines) == 1 and "distributed checkpoint of step 1 failed" in lines[0], proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout
    assert list_steps(tmp_path) == ([], [1])


# ---------------------------------------------------------------- two processes, one script run
_TWO_RANKS = """
import os, sys, time
import torch, torch.distributed as dist, torch.nn as nn
import gapmon

rank, root = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=2)
torch.manual_seed(rank)
model = nn.Linear(4, 3)
model(torch.randn(2, 4)).sum().backward()
dumper = gapmon.GradientDumper(model, f"{root}/dump", async_write=True)  # default timeout: 600 s
dumper.maybe_dump(0)
if rank == 0:
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{root}/dump/step0/COMPLETE") and time.monotonic() < deadline:
        time.sleep(0.01)
dist.barrier()
if rank == 1:
    os._exit(0)  # rank 1 dies before its re-dump of step 0
model.weight.grad.add_(1.0)
start = time.monotonic()
dumper.maybe_dump(0)
try:
    dumper.close()
    print("NO ERROR")
except Exception as e:
    print(f"ERROR after {time.monotonic() - start:.1f}s: {e}")
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.multiprocess
def test_a_rank_that_dies_during_a_re_dump(tmp_path):
    """Rank 1 dies before re-dumping step 0: rank 0 names it within seconds (not after the 600 s
    timeout), and the step is incomplete, never rank 0's new file with rank 1's old one."""
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == 0, out[1][1]
    line = next((x for x in out[0][0].splitlines() if x.startswith(("ERROR", "NO ERROR"))), out[0][0] + out[0][1])
    assert line.startswith("ERROR after") and "rank 1" in line and "exited" in line, line
    assert float(line.split()[2].rstrip("s:")) < 30
    assert list_steps(tmp_path / "dump") == ([], [0])
    with pytest.raises(DumpError, match="incomplete"):
        reconstruct_gradients(tmp_path / "dump", 0)


def test_dump_timings_do_not_regress_a_small_model(tmp_path):
    """Checksums are computed once per tensor; a sync dump of a small model stays fast (a guard
    against reading files back: 20 dumps of 0.3 MB well under 5 s)."""
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 64))
    model(torch.randn(2, 256)).sum().backward()
    start = time.perf_counter()
    with gapmon.GradientDumper(model, tmp_path, async_write=False) as dumper:
        for step in range(20):
            dumper.maybe_dump(step)
    assert time.perf_counter() - start < 5
    assert list_steps(tmp_path)[0] == list(range(20))


def test_a_checkpoint_dcp_cannot_load_is_one_clear_error(tmp_path):
    """Full mode's reader: DCP's own failure (its CheckpointException is a BaseException) becomes
    one DumpError line, also behind consistent checksums (a checkpoint written broken)."""
    with gapmon.GradientDumper(_model(), tmp_path, mode="full", async_write=False) as dumper:
        dumper.maybe_dump(0)
    data = max((tmp_path / "step0" / "full").rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    reseal_complete(tmp_path / "step0")
    with pytest.raises(DumpError, match="full cannot be loaded") as caught:
        reconstruct_gradients(tmp_path, 0)
    assert "\n" not in str(caught.value)
