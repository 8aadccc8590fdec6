"""Per-sample norms under FSDP2 and DDP with 2 gloo processes: ranks that see different samples and
ranks that see the same samples both give the single-process norms (no sqrt(world) inflation), with
and without book-keeping (which then also gives the same gradients)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import run_distributed, seeded_gpt, vmap_per_sample_norms

import gapmon
from gapmon.apps.examples import GPTConfig, lm_loss, synthetic_batch

pytestmark = [pytest.mark.multiprocess]

# T = 24 >= d p / (d + p) for every Linear layer: all take the direct form, so book-keeping covers them.
CFG = GPTConfig(vocab_size=37, seq_len=24, d_model=24, n_heads=2, n_layers=2)
GLOBAL = 6


def _model():
    return seeded_gpt(CFG)


def _accumulated_global_norms(model, psn, x, y, local_ids, micro: int):
    """The global norms of a step of `micro` micro-batches over this rank's samples, each loss divided by `micro`
    (declared with set_loss_weights)."""
    for part in local_ids.chunk(micro):
        loss = lm_loss(model(x[part]), y[part]) / micro
        psn.set_loss_weights(1.0 / (part.numel() * micro))
        loss.backward()
    return psn.global_norms(local_ids)


def _assert_accumulated(model, psn, x, y, local_ids, want, where: str, rtol: float = 1e-4, atol: float = 1e-6):
    """One and two micro-batches of the step over this rank's samples: the global norms in id order, equal to `want`."""
    for micro in (1, 2):
        got_ids, got = _accumulated_global_norms(model, psn, x, y, local_ids, micro)
        case = f"{where}, {micro} micro-batches"
        assert got_ids.tolist() == list(range(GLOBAL)), case
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, c=case: f"{c}: {m}")
        model.zero_grad()


def _worker(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    x, y = synthetic_batch(CFG, GLOBAL, step=2)
    want = vmap_per_sample_norms(_model(), lm_loss, x, y)  # one process, all samples

    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (world,))

    def fsdp2():
        model = _model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def full(grad):
        return grad.full_tensor() if hasattr(grad, "full_tensor") else grad

    ids = torch.arange(GLOBAL)
    layouts = {
        "different samples": ids[rank::world],  # DistributedSampler-style interleaving
        "same samples": ids,
    }
    for wrapper, make in (("fsdp2", fsdp2), ("ddp", lambda: DDP(_model()))):
        grads = {}
        for bookkeeping in (False, True):
            model = make()
            psn = gapmon.PerSampleGradNorms(model, strict=True, bookkeeping=bookkeeping)
            for layout, local_ids in layouts.items():
                where = f"{wrapper} {layout} bookkeeping={bookkeeping}"
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    lm_loss(model(x[local_ids]), y[local_ids]).backward()
                bookkept = sum(e.count for e in prof.key_averages() if e.key == "BookkeepingLinear")
                assert (bookkept > 0) == bookkeeping, (where, bookkept)
                local = psn.local_norms()
                torch.testing.assert_close(local, want[local_ids], rtol=1e-4, atol=1e-6)
                got_ids, got = psn.global_norms(local_ids)
                assert got_ids.tolist() == list(range(GLOBAL)), (where, got_ids)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m, where=where: f"{where}: {m}")
                step_grads = {n: full(p.grad) for n, p in model.named_parameters()}
                for name, grad in grads.setdefault(layout, step_grads).items():
                    torch.testing.assert_close(step_grads[name], grad, rtol=1e-5, atol=1e-7, msg=f"{where} {name}")
                model.zero_grad()
            psn.close()


def test_fsdp2_and_ddp_global_norms():
    run_distributed(_worker, 2)


def _granularity_worker(rank: int, world: int):
    """FSDP2 at every granularity users wrap at (each Linear, each block, the root only), resharding
    after forward or not, HSDP, DDP, two micro-batches with the loss divided by 2 (declared with
    set_loss_weights), GAPMonitor with interval=2, and a model built as large ones are (meta device, activation
    checkpointing, bf16 parameters): never a false refusal, always the float64 norms of each sample's own loss."""
    import warnings

    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = synthetic_batch(CFG, GLOBAL, step=3)
    want = vmap_per_sample_norms(_model(), lm_loss, x, y)
    mesh = init_device_mesh("cpu", (world,))
    hsdp_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))

    def wrap(units: str, reshard: bool, on=mesh):
        model = _model()
        if units == "each Linear":
            for m in model.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    fully_shard(m, mesh=on, reshard_after_forward=reshard)
        elif units == "each block":
            for block in model.blocks:
                fully_shard(block, mesh=on, reshard_after_forward=reshard)
        return fully_shard(model, mesh=on, reshard_after_forward=reshard)

    makers = {f"fsdp2 {units} reshard={reshard}": (lambda u=units, r=reshard: wrap(u, r))
              for units in ("each Linear", "each block", "root only") for reshard in (True, False)}
    makers["hsdp each Linear"] = lambda: wrap("each Linear", True, hsdp_mesh)
    makers["ddp"] = lambda: DDP(_model())
    ids = torch.arange(GLOBAL)
    layouts = {"different samples": ids[rank::world], "same samples": ids}
    for where, make in makers.items():
        model = make()
        psn = gapmon.PerSampleGradNorms(model, strict=True)
        for layout, local_ids in layouts.items():
            _assert_accumulated(model, psn, x, y, local_ids, want, f"{where}, {layout}")
        psn.close()

    # GAPMonitor with interval=2 over FSDP2 per-Linear units: the monitored steps' norms are exact, the
    # skipped step leaves nothing behind.
    model = wrap("each Linear", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing excluded, nothing refused
        mon = gapmon.GAPMonitor(model, interval=2, per_sample_grad_norms=gapmon.PerSampleConfig(strict=True))
    local_ids = ids[rank::world]
    for step in range(3):
        mon.begin_step(step, batch_size=local_ids.numel())
        lm_loss(model(x[local_ids]), y[local_ids]).backward()
        metrics = mon.end_step()
        if step % 2 == 0:
            assert metrics["gap/per_sample_grad_norm/max"] == pytest.approx(want.max().item(), rel=1e-4)
            assert metrics["gap/per_sample_grad_norm/min"] == pytest.approx(want.min().item(), rel=1e-4)
        else:
            assert metrics == {}
        model.zero_grad()
    mon.close()

    # Built as torchtitan and OLMo-core build large models: on the meta device, each block wrapped for activation
    # checkpointing, FSDP2 with bf16 parameters and float32 reduction, then `to_empty` and the weights loaded from a
    # full state dict. No refusal, with and without book-keeping; the norms within bf16's rounding of the float64 ones.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy

    full_state = _model().state_dict()
    for bookkeeping in (False, True):
        with torch.device("meta"):
            model = _model()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
            fully_shard(model.blocks[i], mesh=mesh, mp_policy=policy)
        model = fully_shard(model, mesh=mesh, mp_policy=policy)
        model.to_empty(device="cpu")
        set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True))
        psn = gapmon.PerSampleGradNorms(model, strict=True, bookkeeping=bookkeeping)
        _assert_accumulated(model, psn, x, y, local_ids, want,
                            f"meta init, checkpointed blocks, bf16 parameters, bookkeeping={bookkeeping}", 2e-2, 1e-4)
        psn.close()


def test_no_false_refusal_at_any_fsdp2_granularity():
    run_distributed(_granularity_worker, 2)


def _tied_worker(rank: int, world: int):
    """A GPT whose head is its token embedding's table, under FSDP2 (the pair in one unit, as FSDP2 needs): the
    global norms are the float64 norms of each sample's own loss, with the cross term of the tie, with and without
    book-keeping (the tied head keeps autograd's backward), over one and two micro-batches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def tied():
        model = _model()
        model.head.weight = model.tok.weight
        return model

    x, y = synthetic_batch(CFG, GLOBAL, step=3)
    want = vmap_per_sample_norms(tied(), lm_loss, x, y)
    mesh = init_device_mesh("cpu", (world,))
    local = torch.arange(GLOBAL)[rank::world]
    for units, reshard in (("each block", True), ("root only", False)):
        for bookkeeping in (False, True):
            model = tied()
            if units == "each block":
                for block in model.blocks:
                    fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            model = fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
            psn = gapmon.PerSampleGradNorms(model, strict=True, bookkeeping=bookkeeping)
            assert "tok.weight" in psn.coverage()["covered"]
            for micro in (1, 2):
                _, got = _accumulated_global_norms(model, psn, x, y, local, micro)
                case = f"{units} reshard={reshard} bookkeeping={bookkeeping} {micro} micro-batches"
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m, c=case: f"{c}: {m}")
                model.zero_grad()
            psn.close()

    # The same tie made in the forward (the original OLMo's F.linear(h, wte.weight)): the table followed from the
    # embedding's forward, where FSDP2 has unsharded it (functional_head).
    def functional_head():
        model = _model()
        del model.head

        def forward(idx):
            b, t = idx.shape
            h = model.tok(idx) + model.pos(torch.arange(t).expand(b, t))
            for block in model.blocks:
                h = block(h)
            return F.linear(model.norm(h), model.tok.weight)

        model.forward = forward
        return model

    want = vmap_per_sample_norms(functional_head(), lm_loss, x, y)
    for units, bookkeeping, micro in (("each block", False, 2), ("root only", True, 1)):
        model = functional_head()
        if units == "each block":
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
        psn = gapmon.PerSampleGradNorms(model, strict=True, bookkeeping=bookkeeping)
        _, got = _accumulated_global_norms(model, psn, x, y, local, micro)
        assert "tok.weight" in psn.coverage()["covered"] and not psn.coverage()["skipped_layers"]
        case = f"functional head, {units}, bookkeeping={bookkeeping}, {micro} micro-batches"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m, c=case: f"{c}: {m}")
        psn.close()

    # A vision transformer's own class token and position embedding (free_parameters) under FSDP2: FSDP2 swaps in
    # their unsharded objects for the forward of the module that holds them, a unit of its own or the root.
    from test_free_parameters import TinyViT, _loss

    torch.manual_seed(0)
    vit = TinyViT()
    xs, ys = torch.randn(GLOBAL, 3, 8, 8), torch.randn(GLOBAL, 3)
    want = []
    for i in range(GLOBAL):
        grads = torch.autograd.grad(_loss(vit(xs[i:i + 1]), ys[i:i + 1]), list(vit.parameters()))
        want.append(torch.cat([g.reshape(-1) for g in grads]).norm())
    for units in ("root only", "encoder and root"):
        model = copy.deepcopy(vit)
        if units == "encoder and root":
            fully_shard(model.encoder, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
        psn = gapmon.PerSampleGradNorms(model, strict=True, loss_reduction="sum")
        assert {"pos_embed", "cls_token"} <= set(psn.coverage()["covered"])
        _loss(model(xs[local]), ys[local]).backward()
        got_ids, got = psn.global_norms(local)
        torch.testing.assert_close(got, torch.stack(want), rtol=1e-4, atol=1e-6, msg=lambda m, u=units: f"{u}: {m}")
        psn.close()
    # Made before fully_shard: FSDP2 puts its pre-forward hook first, so the unsharded objects are followed as well.
    model = copy.deepcopy(vit)
    psn = gapmon.PerSampleGradNorms(model, strict=True, loss_reduction="sum")
    model = fully_shard(model, mesh=mesh)
    _loss(model(xs[local]), ys[local]).backward()
    torch.testing.assert_close(psn.global_norms(local)[1], torch.stack(want), rtol=1e-4, atol=1e-6)
    psn.close()
    # MAE's embeddings: slices of the position table, the first row added to the class token (two free parameters
    # summed), their per-sample gradients placed back in the unsharded table.
    from test_free_parameters import MaskedAutoencoderEmbeddings

    torch.manual_seed(1)
    mae = MaskedAutoencoderEmbeddings()
    xs, ys = torch.randn(GLOBAL, 5, 6), torch.randn(GLOBAL, 3)
    want = []
    for i in range(GLOBAL):
        grads = torch.autograd.grad(_loss(mae(xs[i:i + 1]), ys[i:i + 1]), list(mae.parameters()))
        want.append(torch.cat([g.reshape(-1) for g in grads]).norm())
    model = fully_shard(copy.deepcopy(mae), mesh=mesh)
    psn = gapmon.PerSampleGradNorms(model, strict=True, loss_reduction="sum")
    _loss(model(xs[local]), ys[local]).backward()
    torch.testing.assert_close(psn.global_norms(local)[1], torch.stack(want), rtol=1e-4, atol=1e-6)
    psn.close()
    # Swin V2's continuous position bias (followed_through): its MLP's second Linear runs on a followed tensor every
    # sample shares, its input's gradient taken back through a copy of the unsharded weight its forward used.
    from gapmon.apps.examples import WindowAttentionV2

    class TwoBlocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([WindowAttentionV2() for _ in range(2)])

        def forward(self, x):
            return self.blocks[0](x) + self.blocks[1](x)

    torch.manual_seed(2)
    blocks = TwoBlocks().double()
    xs, ys = torch.randn(GLOBAL, 18, 8, dtype=torch.float64), torch.randn(GLOBAL, 8, dtype=torch.float64)
    want = []
    for i in range(GLOBAL):
        grads = torch.autograd.grad(_loss(blocks(xs[i:i + 1]), ys[i:i + 1]), list(blocks.parameters()))
        want.append(torch.cat([g.reshape(-1) for g in grads]).norm())
    for units in ("each Linear", "each block"):
        model = copy.deepcopy(blocks)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) if units == "each Linear" else isinstance(m, WindowAttentionV2):
                fully_shard(m, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
        psn = gapmon.PerSampleGradNorms(model, strict=True, loss_reduction="sum")
        _loss(model(xs[local]), ys[local]).backward()
        assert not psn.coverage()["uncovered"]
        torch.testing.assert_close(psn.global_norms(local)[1], torch.stack(want), rtol=1e-10, atol=1e-12,
                                   msg=lambda m, u=units: f"{u}: {m}")
        psn.close()


def test_a_tied_embedding_and_head_under_fsdp2():
    run_distributed(_tied_worker, 2)
