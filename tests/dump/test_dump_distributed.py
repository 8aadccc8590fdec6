"""Dumps under FSDP2 (world 4, uneven and empty shards) and HSDP (2x2) with gloo: every mode
reconstructs exactly the full gradients (full_tensor() as reference); --verify catches a corrupted
HSDP replica. One spawn for all cases."""
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from helpers import run_distributed
from safetensors import safe_open
from safetensors.torch import save_file

import gapmon
from gapmon.apps.examples import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from gapmon.dump.reconstruct import DumpError, reconstruct_gradients

pytestmark = [pytest.mark.multiprocess]

CFG = GPTConfig(vocab_size=37, seq_len=3, d_model=24, n_heads=2, n_layers=2)  # pos: 3 rows over 4 ranks


def _sharded_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyGPT(CFG)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(rank: int, world: int, root: str):
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"fsdp": init_device_mesh("cpu", (world,)),
              "hsdp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}
    for layout, mesh in meshes.items():
        model = _sharded_model(mesh)
        x, y = synthetic_batch(CFG, 8, 0)
        lm_loss(model(x[rank::world]), y[rank::world]).backward()
        want = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        if layout == "fsdp":
            assert model.pos.weight.grad.to_local().shape[0] == (0 if rank == 3 else 1)
        for mode, kwargs in (("shards", {"async_write": True}), ("shards-sync", {"async_write": False}),
                             ("full", {"async_write": True}), ("full-sync", {"async_write": False}),
                             ("sampled", {"save_first_n": 2})):
            save = f"{root}/{layout}-{mode}"
            with gapmon.GradientDumper(model, save, mode=mode.split("-")[0], **kwargs) as dumper:
                dumper.maybe_dump(3)
            dist.barrier()
            if rank == 0:
                got = reconstruct_gradients(save, 3, verify=mode.startswith("shards"))
                n = kwargs.get("save_first_n")
                for name, full in want.items():
                    ref = full if n is None else full[tuple(slice(0, n) for _ in full.shape)]
                    assert torch.equal(got[name], ref), (layout, mode, name)
                config = json.loads(open(f"{save}/config.json").read())
                assert config["parallel_type"] == layout and config["world_size"] == world
                if layout == "hsdp":
                    assert config["num_replicas"] == 2 and config["shard_degree"] == 2
            dist.barrier()
        dist.barrier()
        if layout == "hsdp":
            _diverged_replicas_are_caught(model, f"{root}/hsdp-diverged", rank)
        if layout == "fsdp":
            for async_write in (False, True):
                _no_rank_plans_before_the_stale_staging_is_gone(model, f"{root}/stale-{async_write}", rank, async_write)
        if layout == "hsdp" and rank == 0:
            _corrupt_replica_is_caught(f"{root}/hsdp-shards")
        if layout == "fsdp" and rank == 0:
            import os

            os.remove(f"{root}/fsdp-shards/step3/rank2.safetensors")
            with pytest.raises(DumpError, match="missing rank file.*rank2.safetensors"):
                reconstruct_gradients(f"{root}/fsdp-shards", 3)
        dist.barrier()


def _no_rank_plans_before_the_stale_staging_is_gone(model, save: str, rank: int, async_write: bool):
    """A staging directory left by an interrupted full dump is removed by rank 0 before any rank
    creates it again in DCP's local plan (a rank whose mkdir met rank 0's removal failed with
    FileExistsError in CI). Rank 0's removal is slowed; every other rank records, when DCP makes
    the staging directory, whether the stale file is still there."""
    import os
    import time

    from torch.distributed.checkpoint.filesystem import FileSystem

    import gapmon.dump.full_checkpoint as full_checkpoint

    stale = f"{save}/step3/.full.tmp/stale.bin"
    if rank == 0:
        os.makedirs(os.path.dirname(stale))
        open(stale, "wb").close()
    dist.barrier()
    seen, mkdir, remove = [], FileSystem.mkdir, full_checkpoint.remove_entry

    def slow_remove(path):
        time.sleep(0.5)
        remove(path)

    def recording_mkdir(fs, path):
        seen.append(os.path.exists(stale))
        mkdir(fs, path)

    FileSystem.mkdir, full_checkpoint.remove_entry = recording_mkdir, slow_remove
    try:
        with gapmon.GradientDumper(model, save, mode="full", async_write=async_write) as dumper:
            dumper.maybe_dump(3)
    finally:
        FileSystem.mkdir, full_checkpoint.remove_entry = mkdir, remove
    assert seen and not any(seen), (rank, async_write, seen)
    dist.barrier()
    if rank == 0:
        assert not os.path.exists(stale)
        got = reconstruct_gradients(save, 3)
        assert set(got) == {n for n, _ in model.named_parameters()}
    dist.barrier()


def _corrupt_replica_is_caught(save: str):
    """A file of replica 1 changed on disk: its checksum fails under --verify; replica 0, which a
    plain reconstruction reads, is intact."""
    path = f"{save}/step3/rank3.safetensors"  # rank 3 = replica 1, shard 1
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["blocks.1.mlp.up.weight"] = tensors["blocks.1.mlp.up.weight"] + 1e-3
    save_file(tensors, path, metadata=meta)
    reconstruct_gradients(save, 3)  # replica 0 is intact: reconstruction without --verify succeeds
    with pytest.raises(DumpError, match=r"rank3.safetensors is corrupt: tensor 'blocks.1.mlp.up.weight'"):
        reconstruct_gradients(save, 3, verify=True)
    proc = subprocess.run([sys.executable, "-m", "gapmon", "reconstruct", save, f"{save}-out", "--step", "3", "--verify"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "rank3.safetensors is corrupt" in proc.stderr


def _diverged_replicas_are_caught(model, save: str, rank: int):
    """Replicas whose gradients differ in memory (a data-parallel bug) are written with consistent
    checksums: --verify's comparison of the replicas is what catches them."""
    grad = model.get_parameter("blocks.1.mlp.up.weight").grad
    if rank == 3:  # replica 1, shard 1
        grad.to_local().add_(1e-3)
    with gapmon.GradientDumper(model, save, async_write=False) as dumper:
        dumper.maybe_dump(3)
    if rank == 3:
        grad.to_local().sub_(1e-3)
    dist.barrier()
    if rank == 0:
        reconstruct_gradients(save, 3)
        with pytest.raises(DumpError, match=r"replica 1 of 'blocks.1.mlp.up.weight' differs"):
            reconstruct_gradients(save, 3, verify=True)
    dist.barrier()


def test_dumps_under_fsdp_and_hsdp(tmp_path):
    run_distributed(_worker, 4, str(tmp_path))


DEAD_RANK = """
import os, sys, time, torch, torch.nn as nn, torch.distributed as dist, torch.multiprocessing as mp
import gapmon

def work(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = nn.Linear(4, 3)
    model(torch.randn(2, 4)).sum().backward()
    mode = sys.argv[3]
    dumper = gapmon.GradientDumper(model, out, async_write=False, timeout=600, mode=mode,
                                   save_first_n=2 if mode == "sampled" else None)
    if rank == 1:
        os.kill(os.getpid(), 9)  # dies before writing its file of step 0
    start = time.monotonic()
    try:
        dumper.maybe_dump(0)
        print(f"RESULT {time.monotonic() - start:.1f}s no error")
    except Exception as e:
        print(f"RESULT {time.monotonic() - start:.1f}s {e}")
    sys.stdout.flush()
    os._exit(0)

if __name__ == "__main__":
    context = mp.spawn(work, args=(2, int(sys.argv[2]), sys.argv[1]), nprocs=2, join=False)  # mode: sys.argv[3]
    context.processes[0].join(120)  # rank 1 is SIGKILLed on purpose: wait for rank 0 alone
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["shards", "full", "sampled"])
def test_a_synchronous_dump_names_a_dead_rank_in_seconds(tmp_path, mode):
    from helpers import free_port

    script = tmp_path / "dead.py"
    script.write_text(DEAD_RANK)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "dumps"), str(free_port()), mode],
                          capture_output=True, text=True, timeout=300)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result, (proc.stdout, proc.stderr[-2000:])
    assert float(result[0].split()[1].removesuffix("s")) < 10  # in seconds, never the 600 s timeout
    if mode == "shards":  # rank 0 waits for rank 1's file: the death is named
        assert "rank 1" in result[0] and "exited" in result[0], result[0]
        assert gapmon.dump.reconstruct.list_steps(tmp_path / "dumps") == ([], [0])
    elif mode == "full":  # named by gapmon, or by gloo's collective when the death races the check
        assert ("rank 1" in result[0] and "exited" in result[0]) or "closed by peer" in result[0], result[0]
    # sampled: rank 0 holds the replicated gradient and writes alone; it may finish before the death shows
