"""Dumps are never silently wrong: run identity, exact shard coverage, step/dtype checks, name
collisions, unclosed dumpers, bad configs and headers (issue: dumps and names)."""
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn as nn
from helpers import reseal_complete
from safetensors import safe_open
from safetensors.torch import save_file

import gapmon
from gapmon.dump.export import gradient_file, write_reconstruction
from gapmon.dump.reconstruct import DumpError, _place, list_steps, reconstruct_gradients


def _linear_with_grad(seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    model(torch.randn(5, 4)).sum().backward()
    return model


def _dump(path, model, steps=(0,)):
    with gapmon.GradientDumper(model, path, async_write=False) as d:
        for s in steps:
            d.maybe_dump(s)
    return d.run_id


def test_every_file_records_the_run(tmp_path):
    run_id = _dump(tmp_path, _linear_with_grad())
    assert json.loads((tmp_path / "config.json").read_text())["run_id"] == run_id
    assert json.loads((tmp_path / "step0" / "COMPLETE").read_text())["run_id"] == run_id
    with safe_open(str(tmp_path / "step0" / "rank0.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["gapmon"])["run_id"] == run_id


def test_rank_file_of_another_run_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _dump(a, _linear_with_grad(0))
    _dump(b, _linear_with_grad(1))
    shutil.copy(b / "step0" / "rank0.safetensors", a / "step0" / "rank0.safetensors")
    with pytest.raises(DumpError, match="another run"):
        reconstruct_gradients(a, 0)


def test_stale_rank_file_never_completes_a_step(tmp_path):
    """Rank 0 waits for this run's files: one left by an earlier run (its writer died) does not count."""
    old = tmp_path / "old"
    _dump(old, _linear_with_grad(1))
    model = _linear_with_grad(0)
    dumper = gapmon.GradientDumper(model, tmp_path / "d", async_write=False, timeout=0.3)
    dumper.world = 2  # as if a rank 1 existed: its file is the stale one
    (tmp_path / "d" / "step0").mkdir(parents=True)
    shutil.copy(old / "step0" / "rank0.safetensors", tmp_path / "d" / "step0" / "rank1.safetensors")
    (tmp_path / "d" / "step0" / "COMPLETE").write_text("{}")  # left by the earlier run too
    with pytest.raises(TimeoutError, match="rank1.safetensors"):
        dumper.maybe_dump(0)
    dumper.close()
    assert list_steps(tmp_path / "d") == ([], [0])


def test_rank_file_of_another_step_is_refused(tmp_path):
    _dump(tmp_path, _linear_with_grad(), steps=(0, 1))
    shutil.copy(tmp_path / "step0" / "rank0.safetensors", tmp_path / "step1" / "rank0.safetensors")
    with pytest.raises(DumpError, match="holds step 0, not step 1"):
        reconstruct_gradients(tmp_path, 1)


def test_shard_dtype_must_match_its_header(tmp_path):
    _dump(tmp_path, _linear_with_grad())
    path = tmp_path / "step0" / "rank0.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k).double() for k in f.keys()}
    save_file(tensors, str(path), metadata=meta)
    reseal_complete(path.parent)
    with pytest.raises(DumpError, match="stored as torch.float64"):
        reconstruct_gradients(tmp_path, 0)


def test_overlapping_or_missing_shards_are_refused():
    a, b = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(DumpError, match="more than once"):
        _place("w", [([0, 0], a), ([1, 0], b)], [4, 3], torch.float32, "here")  # rows 1 twice, row 3 never
    with pytest.raises(DumpError, match="uncovered"):
        _place("w", [([0, 0], a)], [4, 3], torch.float32, "here")
    full = _place("w", [([0, 0], a), ([2, 0], b * 2)], [4, 3], torch.float32, "here")
    assert full[3, 0] == 2 and full[0, 0] == 1


class _HasModuleAttribute(nn.Module):
    """A submodule called `module` next to the model's own `weight`: no wrapper is involved."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(3, 3)
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.module(x) * self.weight


def test_a_submodule_named_module_keeps_its_name(tmp_path):
    model = _HasModuleAttribute()
    model(torch.randn(2, 3)).sum().backward()
    _dump(tmp_path, model)
    assert set(reconstruct_gradients(tmp_path, 0)) == {"module.weight", "module.bias", "weight"}
    with gapmon.GAPMonitor(model, activations=False, activation_grads=False, sinks=[]) as mon:
        mon.begin_step(0)
        metrics = mon.end_step()
    assert {"gap/grads/weight/norm", "gap/grads/module.weight/norm"} <= set(metrics)


def test_ddp_prefix_is_still_removed():
    from gapmon.utils import clean_named

    class FakeDDP(nn.parallel.DistributedDataParallel):
        def __init__(self, module):
            nn.Module.__init__(self)
            self.module = module

    wrapped = FakeDDP(_HasModuleAttribute())
    names = [n for n, _ in clean_named(wrapped, wrapped.named_parameters(), "parameters")]
    assert names == ["weight", "module.weight", "module.bias"]


def test_reconstruction_file_names_are_injective(tmp_path):
    # 100 CJK characters are 300 bytes in UTF-8: a valid torch name, too long for a file name as it is.
    grads = {"a/b": torch.ones(2), "a_b": torch.zeros(2), "x" * 300: torch.ones(1), "层" * 100: torch.ones(3),
             "层" * 99 + "x": torch.zeros(3)}
    files = write_reconstruction(grads, tmp_path, 123456789, {})
    individual = [f for f in files if f.name.startswith("step123456789_") and "all_gradients" not in f.name
                  and f.suffix == ".safetensors"]
    assert len(individual) == 5 and all(len(f.name.encode()) <= 255 for f in individual)
    from safetensors.torch import load_file

    assert {k for f in individual for k in load_file(str(f))} == set(grads)


UNCLOSED = textwrap.dedent("""
    import sys, torch, torch.nn as nn, gapmon
    model = nn.Linear(64, 64)
    model(torch.randn(8, 64)).sum().backward()
    d = gapmon.GradientDumper(model, sys.argv[1], async_write=True)
    for step in range(3):
        d.maybe_dump(step)
    # no close(): the dumper is flushed at interpreter exit
""")


def test_unclosed_async_dumper_writes_every_step(tmp_path):
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        proc = subprocess.run([sys.executable, "-c", UNCLOSED, str(out)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert list_steps(out) == ([0, 1, 2], [])


def test_empty_dump_warns(tmp_path):
    with pytest.warns(RuntimeWarning, match="no gradients"):
        with gapmon.GradientDumper(nn.Linear(2, 2), tmp_path, async_write=False) as d:
            d.maybe_dump(0)


@pytest.mark.parametrize("config, match", [
    ({"world_size": 10**12, "mode": "shards"}, "world_size"),
    ({"world_size": 0, "mode": "shards"}, "world_size"),
    ({"world_size": "two", "mode": "shards"}, "world_size"),
    ([1, 2], "JSON object"),
])
def test_bad_config_is_a_clear_error(tmp_path, config, match):
    _dump(tmp_path, _linear_with_grad())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DumpError, match=match):
        reconstruct_gradients(tmp_path, 0)


def test_missing_header_field_names_file_and_field(tmp_path):
    _dump(tmp_path, _linear_with_grad())
    path = tmp_path / "step0" / "rank0.safetensors"
    with safe_open(str(path), "pt") as f:
        header = json.loads(f.metadata()["gapmon"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    del header["tensors"]["weight"]["local_shape"]
    save_file(tensors, str(path), metadata={"gapmon": json.dumps(header)})
    reseal_complete(path.parent)
    with pytest.raises(DumpError, match="rank0.safetensors.*local_shape"):
        reconstruct_gradients(tmp_path, 0)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_rank_file_does_not_block(tmp_path):
    _dump(tmp_path, _linear_with_grad())
    path = tmp_path / "step0" / "rank0.safetensors"
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(DumpError, match="not a regular file"):
        reconstruct_gradients(tmp_path, 0)


def test_files_follow_the_umask(tmp_path):
    _dump(tmp_path, _linear_with_grad())
    mask = os.umask(0)
    os.umask(mask)
    mode = stat.S_IMODE(os.stat(tmp_path / "step0" / "rank0.safetensors").st_mode)
    assert mode == 0o666 & ~mask


def test_bad_monitor_correction_and_norm_tile():
    with pytest.raises(ValueError, match="correction"):
        gapmon.GAPMonitor(nn.Linear(2, 2), correction="x", sinks=[])
    if gapmon.backend() != "torch":
        ids, g = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, 2)
        for tile in (0, -4):
            with pytest.raises(ValueError, match="tile must be a positive"):
                torch.ops.gapmon.embedding_norm_sq(ids, g, -1, tile)
            with pytest.raises(ValueError, match="tile must be a positive"):
                torch.ops.gapmon.ghost_norm_sq(g, g, tile)
        assert torch.ops.gapmon.embedding_norm_sq(ids, g, -1, None).item() == 18.0  # None: automatic; 3 x 3 pairs of g_t . g_s = 2


def test_stale_temp_files_are_removed_on_start(tmp_path):
    stale, fresh = tmp_path / "step3" / ".rank1.safetensors.abc.tmp", tmp_path / ".config.json.def.tmp"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    old = os.stat(stale).st_mtime - 3600
    os.utime(stale, (old, old))
    gapmon.GradientDumper(nn.Linear(2, 2), tmp_path, timeout=60).close()
    assert not stale.exists() and fresh.exists()  # a recent one may belong to a live writer


def test_jsonl_sink_reopens_a_deleted_file(tmp_path):
    sink = gapmon.JSONLSink(tmp_path / "m.jsonl")
    sink.write(0, {"a": 1.0}, {})
    (tmp_path / "m.jsonl").unlink()
    with pytest.warns(RuntimeWarning, match="deleted"):
        sink.write(1, {"a": 2.0}, {})
    sink.close()
    assert json.loads((tmp_path / "m.jsonl").read_text())["step"] == 1


@pytest.mark.parametrize("pieces", [4, 100])  # box arithmetic, and the per-element count past 64 pieces
def test_coverage_check_with_many_pieces(pieces):
    full = torch.arange(pieces * 6.0).reshape(pieces * 2, 3)
    exact = [([2 * i, 0], full[2 * i:2 * i + 2]) for i in range(pieces)]
    assert torch.equal(_place("w", exact, [pieces * 2, 3], torch.float32, "x"), full)
    shifted = exact[:-1] + [([2 * pieces - 3, 0], full[-3:-1])]  # overlaps its neighbour, leaves the last row
    with pytest.raises(DumpError, match="leave 3 elements uncovered and cover 3 more than once"):
        _place("w", shifted, [pieces * 2, 3], torch.float32, "x")


def test_dump_errors_say_which_kind_of_failure(tmp_path):
    """A caller can tell a step that is not there (yet) from a damaged or mixed-up one: each failure
    raises its DumpError subclass (and every one is still a DumpError)."""
    _dump(tmp_path / "d", _linear_with_grad(), steps=(0, 1))
    d = tmp_path / "d"
    with pytest.raises(gapmon.DumpMissingError, match="does not exist"):
        reconstruct_gradients(tmp_path / "nowhere", 0)
    with pytest.raises(gapmon.DumpMissingError, match="step 5 was not dumped"):
        reconstruct_gradients(d, 5)
    shutil.copytree(d, tmp_path / "e")
    (tmp_path / "e" / "step1" / "COMPLETE").unlink()
    with pytest.raises(gapmon.DumpIncompleteError, match="step 1 is incomplete"):
        reconstruct_gradients(tmp_path / "e", 1)
    shard = d / "step1" / "rank0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10  # a flipped bit in the tensor data
    shard.write_bytes(bytes(data))
    with pytest.raises(gapmon.DumpCorruptError, match="corrupt"):
        reconstruct_gradients(d, 1)
    shutil.copy(d / "step0" / "rank0.safetensors", shard)
    with pytest.raises(gapmon.DumpInconsistentError, match="holds step 0, not step 1"):
        reconstruct_gradients(d, 1)
    for kind in (gapmon.DumpMissingError, gapmon.DumpIncompleteError, gapmon.DumpCorruptError, gapmon.DumpInconsistentError):
        assert issubclass(kind, gapmon.DumpError)


def test_format_records_convert_both_ways_and_refuse_malformed_input(tmp_path):
    from gapmon.dump.format import ShardRecord, dtype_from_name, dtype_name, full_index, read_full_index

    rec = ShardRecord(global_shape=[6, 4], local_shape=[3, 4], offsets=[3, 0], placements=["R", "S(0)"],
                      mesh_shape=[2, 2], coordinate=[1, 1], dtype="bfloat16", checksum=7)
    assert ShardRecord.from_json(json.loads(json.dumps(rec.to_json())), "w", "f") == rec
    assert rec.replica() == 1 and rec.torch_dtype == torch.bfloat16
    for bad, field in ((dict(placements=["X", "S(0)"]), "placements"), (dict(offsets=[-1, 0]), "offsets"),
                       (dict(dtype="int8"), "dtype"), (dict(mesh_shape=[0, 2]), "mesh_shape")):
        with pytest.raises(gapmon.DumpCorruptError, match=field):
            ShardRecord.from_json({**rec.to_json(), **bad}, "w", "f")
    with pytest.raises(gapmon.DumpCorruptError, match="lacks"):
        ShardRecord.from_json({k: v for k, v in rec.to_json().items() if k != "coordinate"}, "w", "f")
    assert [dtype_from_name(dtype_name(d), "x") for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)] \
        == [torch.float16, torch.bfloat16, torch.float32, torch.float64]

    path = tmp_path / "full_index.json"
    with pytest.raises(gapmon.DumpMissingError):
        read_full_index(path)
    path.write_text(json.dumps(full_index({"a": ([2, 3], torch.float32)})))
    assert read_full_index(path) == {"a": ([2, 3], torch.float32)}
    path.write_text(json.dumps({"a": {"shape": [2], "dtype": "torch.bfloat16"}}))  # as earlier versions spelled it
    assert read_full_index(path) == {"a": ([2], torch.bfloat16)}
    for text in ('{"a": {"shape": [2], "dtype": "int8"}}', '{"a": {"shape": [-2], "dtype": "float32"}}', "[1]", "{"):
        path.write_text(text)
        with pytest.raises(gapmon.DumpCorruptError):
            read_full_index(path)


# ------------------------------------------------------------------ round 3: links, modes, vanished dirs
@pytest.mark.parametrize("mode", ["shards", "sampled", "full"])
def test_a_step_directory_that_is_a_link_is_refused_and_nothing_lands_outside(tmp_path, mode):
    outside, dumps = tmp_path / "outside", tmp_path / "dumps"
    outside.mkdir()
    dumps.mkdir()
    (dumps / "step0").symlink_to(outside, target_is_directory=True)
    options = dict(mode=mode, save_first_n=2) if mode == "sampled" else dict(mode=mode)
    with gapmon.GradientDumper(_linear_with_grad(), dumps, async_write=False, **options) as dumper:
        with pytest.raises(OSError, match="symbolic link"):
            dumper.maybe_dump(0)
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("async_write", [False, True])
def test_a_link_planted_at_the_full_staging_dir_is_removed_not_followed(tmp_path, async_write):
    outside, dumps = tmp_path / "outside", tmp_path / "dumps"
    outside.mkdir()
    (dumps / "step0").mkdir(parents=True)
    (dumps / "step0" / ".full.tmp").symlink_to(outside, target_is_directory=True)
    model = _linear_with_grad()
    with gapmon.GradientDumper(model, dumps, mode="full", async_write=async_write) as dumper:
        dumper.maybe_dump(0)
    assert list(outside.iterdir()) == []
    torch.testing.assert_close(reconstruct_gradients(dumps, 0)["weight"], model.weight.grad, rtol=0, atol=0)


def test_files_follow_the_umask_set_after_import(tmp_path):
    old = os.umask(0o077)
    try:
        _dump(tmp_path / "dumps", _linear_with_grad())
        written = write_reconstruction(reconstruct_gradients(tmp_path / "dumps", 0), tmp_path / "out", 0, {})
    finally:
        os.umask(old)
    for path in [tmp_path / "dumps" / "step0" / "rank0.safetensors", tmp_path / "dumps" / "config.json", *written]:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path


def test_a_dump_directory_deleted_between_dumps_leaves_the_next_step_readable(tmp_path):
    model = _linear_with_grad()
    with gapmon.GradientDumper(model, tmp_path / "dumps", async_write=False) as dumper:
        dumper.maybe_dump(0)
        shutil.rmtree(tmp_path / "dumps")
        with pytest.warns(RuntimeWarning, match="vanished"):
            dumper.maybe_dump(1)
    assert list_steps(tmp_path / "dumps") == ([1], [])
    torch.testing.assert_close(reconstruct_gradients(tmp_path / "dumps", 1)["weight"], model.weight.grad, rtol=0, atol=0)


@pytest.mark.parametrize("async_write", [False, True])
def test_full_mode_dumps_a_channels_last_cnn(tmp_path, async_write):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3)).to(memory_format=torch.channels_last)
    model(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    assert not model[0].weight.grad.is_contiguous()
    with gapmon.GradientDumper(model, tmp_path, mode="full", async_write=async_write) as dumper:
        dumper.maybe_dump(0)
    got = reconstruct_gradients(tmp_path, 0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=0, atol=0)


def test_a_failed_full_dump_leaves_no_staging_directory(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    def fail(*args, **kwargs):  # a write that got half way
        (tmp_path / "step0" / ".full.tmp").mkdir(exist_ok=True)
        (tmp_path / "step0" / ".full.tmp" / "model-00001.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", fail)
    with gapmon.GradientDumper(_linear_with_grad(), tmp_path, mode="full", async_write=False) as dumper:
        with pytest.raises(OSError):
            dumper.maybe_dump(0)
    assert not (tmp_path / "step0" / ".full.tmp").exists()


KILLED_WRITER = textwrap.dedent("""
    import sys, torch
    from gapmon.dump.export import write_reconstruction
    out = sys.argv[1]
    i = 0
    while True:
        i += 1
        names = ["w1", "w2", "w3"] if i % 2 else ["w1", "w2", "w4"]  # some names only one generation has
        write_reconstruction({n: torch.full((64, 64), float(i)) for n in names}, out, 0, {})
        if i == 1:
            print("ready", flush=True)
""")


@pytest.mark.slow
def test_reconstruction_output_survives_sigkill_at_random_instants(tmp_path):
    """A writer SIGKILLed at random instants, again and again, over the same output directory: every file
    a reader can open belongs to one generation (old or new, never a mix), the metadata agrees with it,
    and the next write removes what the killed writers left."""
    import random
    import signal

    from safetensors.torch import load_file

    out = tmp_path / "out"
    rng = random.Random(0)
    for attempt in range(8):
        child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(out)], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.2))
        child.send_signal(signal.SIGKILL)
        child.wait()
        values = set()
        for path in out.glob("step0_*"):
            if not path.exists():  # a name only the other generation has: dangling, as an absent file
                continue
            if path.suffix == ".json":
                norms = json.loads(path.read_text())["parameter_norms"]
                values |= {round(v / 64) for v in norms.values()}
            else:
                values |= {t.unique().item() for t in load_file(str(path)).values()}
        assert len(values) == 1, (attempt, values)
        generation = values.pop()
        present = {p.name for p in out.glob("step0_*") if p.exists()}
        wanted = {"w1", "w2", "w3"} if generation % 2 else {"w1", "w2", "w4"}
        assert present == {f"step0_{n}.safetensors" for n in wanted} | {"step0_all_gradients.safetensors",
                                                                         "step0_metadata.json"}, (attempt, present)
    write_reconstruction({"w1": torch.zeros(2)}, out, 0, {})
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".step0.")) == [os.readlink(out / ".step0")]
    assert {p.name for p in out.glob("step0_*") if p.exists()} == {"step0_w1.safetensors", "step0_all_gradients.safetensors",
                                                                   "step0_metadata.json"}


def test_a_name_collision_is_refused_before_anything_is_written(tmp_path):
    from safetensors.torch import load_file

    write_reconstruction({"w": torch.ones(2)}, tmp_path, 0, {})
    before = {p.name: p.read_bytes() for p in tmp_path.glob("step0_*")}
    with pytest.raises(DumpError, match="all_gradients.*nothing was written"):
        write_reconstruction({"all_gradients": torch.zeros(2), "w": torch.zeros(2)}, tmp_path, 0, {})
    assert {p.name: p.read_bytes() for p in tmp_path.glob("step0_*")} == before
    assert load_file(str(tmp_path / "step0_all_gradients.safetensors"))["w"].tolist() == [1.0, 1.0]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".step0.")] == [os.readlink(tmp_path / ".step0")]


def test_the_cli_reconstructs_a_model_with_names_too_long_for_file_names(tmp_path):
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.add_module("层" * 100, nn.Linear(3, 2))

    model = Deep()
    getattr(model, "层" * 100)(torch.randn(4, 3)).sum().backward()
    _dump(tmp_path / "dumps", model)
    proc = subprocess.run([sys.executable, "-m", "gapmon", "reconstruct", str(tmp_path / "dumps"), str(tmp_path / "out"),
                           "--step", "0", "--quiet"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file

    got = {k: v for f in (tmp_path / "out").glob("step0_*.safetensors") if "all_gradients" not in f.name
           for k, v in load_file(str(f)).items()}
    assert set(got) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert len(gradient_file(0, name).encode()) <= 255
        torch.testing.assert_close(got[name], p.grad)


def test_a_configuration_without_world_size_names_the_field(tmp_path):
    _dump(tmp_path, _linear_with_grad())
    config = json.loads((tmp_path / "config.json").read_text())
    del config["world_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DumpError, match="'world_size' is missing"):
        gapmon.dump.reconstruct.read_config(tmp_path)
    complete = json.loads((tmp_path / "step0" / "COMPLETE").read_text())
    del complete["world_size"], complete["config"]["world_size"]
    (tmp_path / "step0" / "COMPLETE").write_text(json.dumps(complete))
    reseal_complete(tmp_path / "step0")
    with pytest.raises(DumpError, match="world_size"):
        reconstruct_gradients(tmp_path, 0)


def test_a_planted_pointer_never_makes_the_writer_remove_what_it_names(tmp_path):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "data").write_bytes(b"keep")
    (tmp_path / ".step0").symlink_to("precious", target_is_directory=True)
    write_reconstruction({"w": torch.ones(2)}, tmp_path, 0, {})
    assert (tmp_path / "precious" / "data").read_bytes() == b"keep"


def test_a_full_disk_mid_reconstruction_leaves_the_earlier_one_and_nothing_else(tmp_path, monkeypatch):
    import safetensors.torch

    write_reconstruction({"w": torch.ones(2), "v": torch.ones(3)}, tmp_path, 0, {})
    before = {p.name: p.read_bytes() for p in tmp_path.glob("step0_*")}
    entries = sorted(p.name for p in tmp_path.iterdir())
    real, calls = safetensors.torch.save_file, []

    def fills_up(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:  # the second file of the new generation finds the disk full
            raise OSError(28, "No space left on device")
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", fills_up)
    with pytest.raises(OSError):
        write_reconstruction({"w": torch.zeros(2), "v": torch.zeros(3)}, tmp_path, 0, {})
    assert {p.name: p.read_bytes() for p in tmp_path.glob("step0_*")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == entries


def test_loss_weights_are_copied_when_declared():
    model = nn.Linear(3, 2).double()
    norms = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    x = torch.randn(2, 3, dtype=torch.float64)
    w = torch.tensor([1.0, 2.0], dtype=torch.float64)
    losses = model(x).square().sum(1)
    norms.set_loss_weights(w)
    (losses * w).sum().backward()
    w.mul_(10)  # the caller reuses its buffer: the declared weights stay as they were
    got = norms.local_norms().tolist()
    norms.close()
    want = []
    for i in range(2):
        model.zero_grad()
        model(x[i:i + 1]).square().sum().backward()
        want.append(float(sum(p.grad.square().sum() for p in model.parameters())) ** 0.5)
    assert got == pytest.approx(want, rel=1e-12)
