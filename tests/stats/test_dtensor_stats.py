"""Exact full-tensor statistics of DTensors under gloo: FSDP (1-D) and HSDP (2-D) meshes,
uneven and empty local shards, 2-D sharding and Partial placements. One spawn per world size."""
import pytest
import torch
from helpers import assert_stats_match, float64_stats, run_distributed

import gapmon

pytestmark = [pytest.mark.multiprocess]

# Shapes chosen so that some ranks get uneven or empty shards along dim 0 (torch.chunk rule).
SHAPES = [(5, 3), (3,), (1, 4), (0, 4), (17, 8), (64, 33), (70_001,)]


def _full_tensors():
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(*s, generator=g) * 3 + 100 for s in SHAPES]
    xs.append((torch.randn(9, 6, generator=g)).bfloat16())
    xs[1][2] = 0.0
    return xs


def _check_all(rank, xs, dts, where):
    got = gapmon.multi_tensor_stats(dts)
    for i, x in enumerate(xs):
        assert_stats_match(gapmon.Stats(*(f[i] for f in got)), float64_stats(x), where=f"{where} rank{rank} t{i}")
        single = gapmon.tensor_stats(dts[i])
        assert_stats_match(single, float64_stats(x), where=f"{where} single rank{rank} t{i}")


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    xs = _full_tensors()
    mesh = init_device_mesh("cpu", (world,))
    # FSDP2 layout: Shard(0) over all ranks.
    dts = [distribute_tensor(x, mesh, [Shard(0)]) for x in xs]
    if world == 4:
        assert dts[0].to_local().shape[0] == 1 if rank == 2 else True
        assert any(d.to_local().numel() == 0 for d in dts), "expected an empty local shard"
    _check_all(rank, xs, dts, "fsdp")
    # Replicated tensors: local state is already complete and must not be counted `world` times.
    _check_all(rank, xs, [distribute_tensor(x, mesh, [Replicate()]) for x in xs], "replicate")
    # Mixed list: DTensors and a plain tensor.
    mixed = gapmon.multi_tensor_stats([dts[4], xs[5], dts[6]])
    assert mixed.count.tolist() == [xs[4].numel(), xs[5].numel(), xs[6].numel()]
    # Partial placement: local values are summands of the real tensor.
    part = DTensor.from_local(xs[4] / world, mesh, [Partial()])
    assert_stats_match(gapmon.tensor_stats(part), float64_stats(xs[4]), where="partial", rtol=1e-4)
    # instance_stats on a batch-sharded DTensor: each rank gets its own instances.
    inst = gapmon.instance_stats(dts[5])
    full = inst.var.full_tensor()
    torch.testing.assert_close(full, xs[5].double().var(dim=1))

    _check_numerics(rank, xs, dts, "fsdp")
    _check_numerics(rank, xs, [distribute_tensor(x, mesh, [Replicate()]) for x in xs], "replicate")

    if world == 4:
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        _check_all(rank, xs, [distribute_tensor(x, hsdp, [Replicate(), Shard(0)]) for x in xs], "hsdp")
        _check_numerics(rank, xs, [distribute_tensor(x, hsdp, [Replicate(), Shard(0)]) for x in xs], "hsdp")
        two_d = [distribute_tensor(x, hsdp, [Shard(0), Shard(x.dim() - 1)]) for x in xs if x.dim() == 2]
        _check_all(rank, [x for x in xs if x.dim() == 2], two_d, "2d-shard")
        _check_numerics(rank, [x for x in xs if x.dim() == 2], two_d, "2d-shard")


def _check_numerics(rank, xs, dts, where):
    """Exponent histograms of the shards merged equal the full tensor's; moments to float64 rounding."""
    from gapmon import numerics, reference

    got = gapmon.numerics_states(dts)
    want = reference.numerics_states(xs)
    bins = numerics.NUM_BINS
    assert torch.equal(got[:, :bins], want[:, :bins]), f"{where} rank{rank}: histograms differ"
    torch.testing.assert_close(got[:, bins:], want[:, bins:], rtol=1e-9, atol=1e-6, msg=f"{where} rank{rank}")


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_exact(world):
    run_distributed(_worker, world)
