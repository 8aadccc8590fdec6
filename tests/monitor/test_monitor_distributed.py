"""GAPMonitor under FSDP2 (1-D, uneven and empty shards), HSDP (2x2) and DDP with gloo: the metrics
equal those of one process on the same global batch, numerics included (the activations' rows are
all-gathered and merged over ranks). One spawn per world size."""
import pytest
import torch
import torch.distributed as dist
from helpers import assert_metrics_close, run_distributed, seeded_gpt

import gapmon
from gapmon.apps.examples import GPTConfig, lm_loss, synthetic_batch

pytestmark = [pytest.mark.multiprocess]

# seq_len=3 gives the position embedding 3 rows: over 4 ranks one shard is empty; vocab 37 is uneven.
CFG = GPTConfig(vocab_size=37, seq_len=3, d_model=24, n_heads=2, n_layers=2)
PER_RANK = 2
NUMERICS = ("bf16", "fp8_e4m3")


def _fresh_model():
    return seeded_gpt(CFG)


def _reference_metrics(world: int, steps: int, solo_group) -> list[dict]:
    """One process, the global batch of every step (all ranks' samples), loss summed over samples."""
    model = _fresh_model()
    out = []
    with gapmon.GAPMonitor(model, sinks=[], process_group=solo_group, numerics=NUMERICS) as mon:
        for step in range(steps):
            x, y = synthetic_batch(CFG, PER_RANK * world, step)
            mon.begin_step(step, batch_size=PER_RANK * world)
            for r in range(world):  # micro-batch per simulated rank, as the ranks see them
                sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
                lm_loss(model(x[sl]), y[sl], reduction="sum").backward()
            out.append(mon.end_step())
            model.zero_grad()
    return out


def _run(rank: int, world: int, model, steps: int) -> list[dict]:
    out = []
    with gapmon.GAPMonitor(model, sinks=[], numerics=NUMERICS) as mon:
        for step in range(steps):
            x, y = synthetic_batch(CFG, PER_RANK * world, step)
            sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            mon.begin_step(step, batch_size=PER_RANK)
            lm_loss(model(x[sl]), y[sl], reduction="sum").backward()
            out.append(mon.end_step())
            model.zero_grad()
    return out


def _sum_reduction(model):
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # gloo's AVG reduce-scatter is unreliable: force SUM
            m.set_force_sum_reduction_for_comms(True)


def _fsdp(mesh):
    from torch.distributed.fsdp import fully_shard

    model = _fresh_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _sum_reduction(model)
    return model


def _fsdp1():
    """FSDP1 with use_orig_params=True: parameters are flat views of uneven (and empty) local pieces."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from gapmon.apps.examples import Block

    return FSDP(_fresh_model(), device_id=torch.device("cpu"), use_orig_params=True,
                auto_wrap_policy=ModuleWrapPolicy({Block}))


def _worker(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = 2
    solo = [dist.new_group([r]) for r in range(world)][rank]  # the reference must not all-reduce
    want = _reference_metrics(world, steps, solo)
    layouts = {"fsdp": lambda: _fsdp(init_device_mesh("cpu", (world,)))}
    if world == 4:
        layouts["hsdp"] = lambda: _fsdp(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    if world == 2:
        layouts["ddp"] = lambda: DDP(_fresh_model())
        layouts["fsdp1"] = _fsdp1
    for name, make in layouts.items():
        model = make()
        if name == "fsdp" and world == 4:
            assert model.pos.weight.to_local().numel() == 0 if rank == 3 else True
        got = _run(rank, world, model, steps)
        for step in range(steps):
            # DDP and FSDP1 average gradients over ranks; compare their grads after undoing the mean.
            mean = name in ("ddp", "fsdp1")
            g = {k: (v * world if mean and k.startswith("gap/grads/") and k.split("/")[-1] in ("max", "mean", "norm")
                     else v * world * world if mean and k.startswith("gap/grads/") and k.endswith("/var") else v)
                 for k, v in got[step].items()}
            # Averaged gradients sit 1/world lower on the exponent line: their shares differ by design.
            shifted = [k for k in g if mean and k.startswith("gap/grads/") and k.endswith(("_underflow", "_overflow"))]
            w = {k: v for k, v in want[step].items() if k not in shifted}
            g = {k: v for k, v in g.items() if k not in shifted}
            assert any(k.startswith("gap/activations/") and k.endswith("/bf16_underflow") for k in g)
            try:
                assert_metrics_close(g, w, rtol=2e-4, atol=1e-6)
            except AssertionError as e:
                raise AssertionError(f"{name} world {world} rank {rank} step {step}: {e}") from None
            assert g["gap/global_batch_size"] == PER_RANK * world


@pytest.mark.parametrize("world", [2, 4])
def test_monitor_matches_single_process(world):
    run_distributed(_worker, world)
