"""Per-sample norms under FSDP2 with 2 gloo processes: ranks that see different samples and ranks
that see the same samples both give the single-process norms (no sqrt(world) inflation)."""
import pytest
import torch
from helpers import run_distributed, seeded_gpt, vmap_per_sample_norms

import gapmon
from gapmon.apps.examples import GPTConfig, lm_loss, synthetic_batch

pytestmark = [pytest.mark.multiprocess]

CFG = GPTConfig(vocab_size=37, seq_len=8, d_model=24, n_heads=2, n_layers=2)
GLOBAL = 6


def _model():
    return seeded_gpt(CFG)


def _worker(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    x, y = synthetic_batch(CFG, GLOBAL, step=2)
    want = vmap_per_sample_norms(_model(), lm_loss, x, y)  # one process, all samples

    from torch.nn.parallel import DistributedDataParallel as DDP

    fsdp = _model()
    mesh = init_device_mesh("cpu", (world,))
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    ids = torch.arange(GLOBAL)
    layouts = {
        "different samples": ids[rank::world],  # DistributedSampler-style interleaving
        "same samples": ids,
    }
    for wrapper, model in (("fsdp2", fsdp), ("ddp", DDP(_model()))):
        psn = gapmon.PerSampleGradNorms(model, strict=True)
        for layout, local_ids in layouts.items():
            lm_loss(model(x[local_ids]), y[local_ids]).backward()
            local = psn.local_norms()
            torch.testing.assert_close(local, want[local_ids], rtol=1e-4, atol=1e-6)
            got_ids, got = psn.global_norms(local_ids)
            assert got_ids.tolist() == list(range(GLOBAL)), (wrapper, layout, got_ids)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m, where=f"{wrapper} {layout}": f"{where}: {m}")
            model.zero_grad()
        psn.close()


def test_fsdp2_and_ddp_global_norms():
    run_distributed(_worker, 2)
