"""The gradient noise scale (gap/gns/...) against a direct computation from materialised per-sample gradients
in float64: micro-batches, declared loss weights, gradient accumulation, layer types, the moving averages,
and data-parallel ranks (DDP, gloo) holding different samples."""
import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers import cpu_mesh, run_distributed

import gapmon
from gapmon.monitor.noise_scale import noise_estimates

VOCAB, T = 11, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.norm = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 5)
        self.head = nn.Linear(5, VOCAB)

    def forward(self, ids):
        return self.head(torch.tanh(self.fc(self.norm(self.emb(ids)))))


def _net(seed=0):
    torch.manual_seed(seed)
    return Net().double()


def _own_losses(model, ids, labels):
    """Each sample's own loss: the mean cross entropy over its tokens."""
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(len(ids), -1).mean(1)


def _layer_type(name):
    return {"emb": "Embedding", "norm": "LayerNorm", "fc": "Linear", "head": "Linear"}[name.split(".")[0]]


def _per_sample_grads(model, ids, labels):
    """{group: [B, P] float64 per-sample gradients of each sample's own loss} for "all" and each layer type."""
    rows = []
    for i in range(len(ids)):
        loss = _own_losses(model, ids[i:i + 1], labels[i:i + 1]).sum()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        rows.append({n: g.reshape(-1) for (n, _), g in zip(model.named_parameters(), grads)})
    groups = {"all": list(rows[0]), **{t: [n for n in rows[0] if _layer_type(n) == t] for t in ("Embedding", "LayerNorm", "Linear")}}
    return {g: torch.stack([torch.cat([r[n] for n in names]) for r in rows]) for g, names in groups.items()}


def _reference(per_sample, weights):
    """(|G|^2, tr Sigma) per group from per-sample gradients g_i and the gradient's weights w_i: the batch
    gradient is sum_i w_i g_i, built here from the g_i (not read from the model)."""
    w = weights.double()
    out = {}
    for group, g in per_sample.items():
        batch = (w[:, None] * g).sum(0)
        mean_sq = (g * g).sum(1).mean()
        w1, w2 = w.sum(), (w * w).sum()
        grad_sq = ((batch @ batch) - w2 * mean_sq) / (w1 * w1 - w2)
        out[group] = (grad_sq.item(), (mean_sq - grad_sq).item())
    return out


def _batch(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, T), generator=g), torch.randint(0, VOCAB, (n, T), generator=g)


def test_uniform_weights_give_the_two_batch_estimator():
    """With w_i = 1/B the general estimate is McCandlish's: |G|^2 = (B|g|^2 - mean S)/(B - 1)."""
    B, g2, s = 8, 3.0, 5.0
    grad_sq, trace = noise_estimates(g2, s, 1.0, B / B ** 2)
    assert grad_sq == pytest.approx((B * g2 - s) / (B - 1)) and trace == pytest.approx(B * (s - g2) / (B - 1))
    assert noise_estimates(g2, s, 1.0, 1.0) is None  # one sample: |G|^2 and tr(Sigma) cannot be told apart


@pytest.mark.parametrize("declared", [False, True], ids=["loss_reduction_mean", "declared_weights"])
def test_noise_scale_matches_materialised_per_sample_gradients(declared):
    """Two monitored steps of two micro-batches each (gradients accumulated): every group's |G|^2 and
    tr(Sigma) equal the float64 computation from per-sample gradients, and b_simple is the ratio of their
    moving averages."""
    model = _net()
    decay = 0.5
    history = {}
    with gapmon.GAPMonitor(model, per_sample_grad_norms=True, activations=False, activation_grads=False,
                           gns_ema=decay) as mon:
        for step in range(2):
            mon.begin_step(step)
            batches = [_batch(10 * step + k, n) for k, n in enumerate((3, 4))]
            weights = []
            for ids, labels in batches:
                losses = _own_losses(model, ids, labels)
                w = (torch.arange(1, len(ids) + 1, dtype=torch.float64) / 10 if declared
                     else torch.full((len(ids),), 1.0 / len(ids), dtype=torch.float64))
                if declared:
                    mon.per_sample.set_loss_weights(w)
                (losses * w).sum().backward()
                weights.append(w)
            metrics = mon.end_step()
            ids = torch.cat([b[0] for b in batches])
            labels = torch.cat([b[1] for b in batches])
            want = _reference(_per_sample_grads(model, ids, labels), torch.cat(weights))
            for group, (grad_sq, trace) in want.items():
                assert metrics[f"gap/gns/{group}/grad_norm_sq"] == pytest.approx(grad_sq, rel=1e-9, abs=1e-12), group
                assert metrics[f"gap/gns/{group}/noise_trace"] == pytest.approx(trace, rel=1e-9, abs=1e-12), group
                assert metrics[f"gap/gns/{group}/b_simple_step"] == pytest.approx(trace / grad_sq, rel=1e-7)
                old = history.get(group)
                avg = (grad_sq, trace) if old is None else tuple(decay * o + (1 - decay) * v for o, v in zip(old, (grad_sq, trace)))
                history[group] = avg
                assert metrics[f"gap/gns/{group}/b_simple"] == pytest.approx(avg[1] / avg[0], rel=1e-7)
            model.zero_grad()


def test_noise_scale_without_gradient_metrics_measures_the_covered_gradients():
    """grads=False: the monitor measures the covered gradients' norms itself; the same numbers."""
    results = []
    for grads in (True, False):
        model = _net()
        with gapmon.GAPMonitor(model, per_sample_grad_norms=True, grads=grads, activations=False,
                               activation_grads=False) as mon:
            mon.begin_step(0)
            ids, labels = _batch(1, 5)
            _own_losses(model, ids, labels).mean().backward()
            results.append({k: v for k, v in mon.end_step().items() if k.startswith("gap/gns/")})
    assert results[0].keys() == results[1].keys() and len(results[0]) == 16
    for key, value in results[0].items():
        assert results[1][key] == pytest.approx(value, rel=1e-12), key


def _ddp_worker(rank, world):
    model = _net()
    ddp = nn.parallel.DistributedDataParallel(model)
    all_ids, all_labels = _batch(7, 6)
    mine = slice(3 * rank, 3 * rank + 3)  # different samples on each rank
    with gapmon.GAPMonitor(ddp, per_sample_grad_norms=True, activations=False, activation_grads=False) as mon:
        mon.begin_step(0)
        _own_losses(ddp, all_ids[mine], all_labels[mine]).mean().backward()  # DDP averages the two ranks
        metrics = mon.end_step()
    want = _reference(_per_sample_grads(_net(), all_ids, all_labels), torch.full((6,), 1.0 / 6, dtype=torch.float64))
    for group, (grad_sq, trace) in want.items():
        got = (metrics[f"gap/gns/{group}/grad_norm_sq"], metrics[f"gap/gns/{group}/noise_trace"])
        assert got == pytest.approx((grad_sq, trace), rel=1e-9, abs=1e-12), (rank, group, got, (grad_sq, trace))
    assert math.isfinite(metrics["gap/gns/all/b_simple"])
    dist.barrier()
    # Ranks that share samples (ids say which): rank 0 holds samples 0-3, rank 1 samples 2-5 (2 and 3 on
    # both, as in a tensor-parallel group or overlapping shards of data). Each counts once, with the sum of
    # its weights (1/4 / 2 per rank): the estimate equals the one over the 6 distinct samples.
    for use_add_samples in (False, True):
        model = _net()
        ddp = nn.parallel.DistributedDataParallel(model)
        mine = torch.arange(4) + 2 * rank
        with gapmon.GAPMonitor(ddp, per_sample_grad_norms=True, activations=False, activation_grads=False) as mon:
            if use_add_samples:  # two micro-batches of 2 (each sample weighs 1/4 in the rank's loss), ids with each
                mon.begin_step(0)
                for k, part in enumerate((mine[:2], mine[2:])):
                    mon.add_samples(2, sample_ids=part)
                    with ddp.no_sync() if k == 0 else contextlib.nullcontext():
                        losses = _own_losses(ddp, all_ids[part], all_labels[part])
                        mon.per_sample.set_loss_weights(torch.full((2,), 0.25, dtype=torch.float64))
                        (losses * 0.25).sum().backward()
            else:
                mon.begin_step(0, sample_ids=mine.tolist())
                _own_losses(ddp, all_ids[mine], all_labels[mine]).mean().backward()
            metrics = mon.end_step()
        weights = torch.tensor([1, 1, 2, 2, 1, 1], dtype=torch.float64) / 8
        want = _reference(_per_sample_grads(_net(), all_ids, all_labels), weights)
        for group, (grad_sq, trace) in want.items():
            got = (metrics[f"gap/gns/{group}/grad_norm_sq"], metrics[f"gap/gns/{group}/noise_trace"])
            assert got == pytest.approx((grad_sq, trace), rel=1e-9, abs=1e-12), (rank, group, got, (grad_sq, trace))
        dist.barrier()


@pytest.mark.multiprocess
def test_noise_scale_under_ddp_equals_the_global_batch_computation():
    run_distributed(_ddp_worker, 2)


def _refused_ids_worker(rank, world):
    """One rank's sample ids refused (too few for its samples; an id repeated over its micro-batches): every
    rank raises the same error naming that rank, none is left waiting in the gather."""
    all_ids, all_labels = _batch(9, 6)
    mine = torch.arange(3) + 3 * rank
    for case in ("count", "repeated"):
        ddp = nn.parallel.DistributedDataParallel(_net())
        with gapmon.GAPMonitor(ddp, per_sample_grad_norms=True, activations=False, activation_grads=False) as mon:
            if case == "count":
                mon.begin_step(0, sample_ids=mine.tolist() if rank == 0 else mine[:2].tolist())
                _own_losses(ddp, all_ids[mine], all_labels[mine]).mean().backward()
            else:
                mon.begin_step(0)
                for k, part in enumerate((mine[:2], mine[2:])):
                    mon.add_samples(len(part), sample_ids=part if rank == 0 or k == 0 else mine[:1])
                    with ddp.no_sync() if k == 0 else contextlib.nullcontext():
                        _own_losses(ddp, all_ids[part], all_labels[part]).mean().backward()
            with pytest.raises(ValueError, match=r"rank\(s\) \[1\]"):
                mon.end_step()
        dist.barrier()


@pytest.mark.multiprocess
def test_a_rank_with_refused_sample_ids_makes_every_rank_raise():
    run_distributed(_refused_ids_worker, 2)


def _data_parallel_worker(rank, world):
    """DDP with the monitor's communication hook: the two-batch estimate from each rank's local mean gradient
    (3 samples, or 6 over two micro-batches accumulated under no_sync) and the global one equals the
    computation from per-sample gradients; every rank's local gradient norm is reported."""
    from gapmon.monitor.noise_scale import two_batch_estimates

    for micro_batches in (1, 2):
        model = _net()
        ddp = nn.parallel.DistributedDataParallel(model)
        local = 3 * micro_batches
        all_ids, all_labels = _batch(11 + micro_batches, local * world)
        with gapmon.GAPMonitor(ddp, activations=False, activation_grads=False) as mon:
            mon.watch_data_parallel(ddp)
            mon.begin_step(0, batch_size=local)
            for k in range(micro_batches):
                rows = slice(local * rank + 3 * k, local * rank + 3 * k + 3)
                context = ddp.no_sync() if k < micro_batches - 1 else torch.enable_grad()
                with context:
                    (_own_losses(ddp, all_ids[rows], all_labels[rows]).mean() / micro_batches).backward()
            metrics = mon.end_step()
        g = _per_sample_grads(_net(), all_ids, all_labels)["all"]
        small = [g[local * r:local * (r + 1)].mean(0) for r in range(world)]
        big = g.mean(0)
        want = two_batch_estimates(sum((s @ s).item() for s in small) / world, (big @ big).item(), local, local * world)
        got = (metrics["gap/gns/data_parallel/grad_norm_sq"], metrics["gap/gns/data_parallel/noise_trace"])
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (micro_batches, got, want)
        norms = [s.norm().item() for s in small]
        assert metrics["gap/local_grad_norm/max"] == pytest.approx(max(norms), rel=1e-9)
        assert metrics["gap/local_grad_norm/min"] == pytest.approx(min(norms), rel=1e-9)
        assert metrics["gap/local_grad_norm/max_rank"] == norms.index(max(norms))
        dist.barrier()
    # Two micro-batches, each synchronised: two reductions in one step are left out, with a warning.
    import warnings

    ddp = nn.parallel.DistributedDataParallel(_net())
    ids, labels = _batch(5, 4)
    with gapmon.GAPMonitor(ddp, activations=False, activation_grads=False) as mon, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon.watch_data_parallel(ddp)
        mon.begin_step(0, batch_size=4)
        for k in range(2):
            _own_losses(ddp, ids[2 * k:2 * k + 2], labels[2 * k:2 * k + 2]).mean().backward()
        metrics = mon.end_step()
    assert not any(name.startswith("gap/gns/data_parallel") for name in metrics), metrics
    assert any("reduced more than once" in str(w.message) for w in caught)


@pytest.mark.multiprocess
def test_noise_scale_from_ddp_reduction_without_per_sample_norms():
    run_distributed(_data_parallel_worker, 2)


def _fsdp2_worker(rank, world):
    """FSDP2 at layer granularity, each rank its own 3 samples: the estimates equal the computation from
    per-sample gradients whether the reduction sums (divide factor 1) or averages (factor 2, explicit)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = cpu_mesh(world)  # a GPU machine's default mesh would be a CUDA one
    for factor in (1.0, 2.0):
        model = _net()
        for layer in (model.emb, model.norm, model.fc, model.head):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(factor)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM and a shaky AVG
        all_ids, all_labels = _batch(21, 3 * world)
        mine = slice(3 * rank, 3 * rank + 3)
        with gapmon.GAPMonitor(model, per_sample_grad_norms=True, activations=False, activation_grads=False) as mon:
            mon.begin_step(0)
            _own_losses(model, all_ids[mine], all_labels[mine]).mean().backward()
            metrics = mon.end_step()
        weights = torch.full((3 * world,), 1.0 / 3 / factor, dtype=torch.float64)  # local means, summed / factor
        want = _reference(_per_sample_grads(_net(), all_ids, all_labels), weights)
        for group, (grad_sq, trace) in want.items():
            got = (metrics[f"gap/gns/{group}/grad_norm_sq"], metrics[f"gap/gns/{group}/noise_trace"])
            assert got == pytest.approx((grad_sq, trace), rel=1e-9, abs=1e-12), (rank, factor, group, got)
        dist.barrier()


@pytest.mark.multiprocess
def test_noise_scale_under_fsdp2_follows_its_gradient_divide_factor():
    run_distributed(_fsdp2_worker, 2)


def _fsdp2_reduction_case(mesh, rank, world, factor, micro_batches, sync_every_micro_batch=False, leftover=False):
    """One monitored step of an FSDP2 (or HSDP) model wrapped per layer, the noise scale read from its
    reduction; each rank holds its own 2 samples per micro-batch. Returns the metrics and the per-sample
    reference (|G_small|^2 averaged over ranks, |G_big|^2, local and global batch)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from gapmon.monitor.noise_scale import two_batch_estimates

    model = _net()
    for layer in (model.emb, model.norm, model.fc, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            if factor is not None:
                m.set_gradient_divide_factor(factor)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM and a shaky AVG
    local = 2 * micro_batches
    all_ids, all_labels = _batch(31 + micro_batches, local * world)
    with gapmon.GAPMonitor(model, activations=False, activation_grads=False) as mon:
        mon.watch_data_parallel(model)
        if leftover:  # gradients of an earlier backward, not zeroed
            _own_losses(model, all_ids[:2], all_labels[:2]).mean().backward()
        mon.begin_step(0, batch_size=local)
        for k in range(micro_batches):
            if not sync_every_micro_batch:
                model.set_requires_gradient_sync(k == micro_batches - 1)
            rows = slice(local * rank + 2 * k, local * rank + 2 * k + 2)
            (_own_losses(model, all_ids[rows], all_labels[rows]).mean() / micro_batches).backward()
        metrics = mon.end_step()
    g = _per_sample_grads(_net(), all_ids, all_labels)["all"]
    small = [g[local * r:local * (r + 1)].mean(0) for r in range(world)]
    big = g.mean(0)
    want = two_batch_estimates(sum((s @ s).item() for s in small) / world, (big @ big).item(), local, local * world)
    return metrics, want, [s.norm().item() for s in small]


def _fsdp2_reduction_worker(rank, world):
    """FSDP2 (world 2) or HSDP (world 4: 2 replicas x 2 shards): the two-batch estimate from the wrapped
    reduce-scatter equals the per-sample computation for divide factors None (the mean), 1 and 2 (float64
    reduces with a predivide factor), with accumulation under set_requires_gradient_sync(False); a step that
    reduces every micro-batch is left out with a warning, not misreported."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,)) if world == 2 else init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for factor, micro_batches in ((None, 1), (1.0, 2), (2.0, 1)):
        metrics, want, norms = _fsdp2_reduction_case(mesh, rank, world, factor, micro_batches)
        got = (metrics["gap/gns/data_parallel/grad_norm_sq"], metrics["gap/gns/data_parallel/noise_trace"])
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (rank, factor, micro_batches, got, want)
        assert metrics["gap/local_grad_norm/max"] == pytest.approx(max(norms), rel=1e-9)
        assert metrics["gap/local_grad_norm/max_rank"] == norms.index(max(norms))
        dist.barrier()
    for case in ({"sync_every_micro_batch": True}, {"leftover": True}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics, _, _ = _fsdp2_reduction_case(mesh, rank, world, None, 2 if "sync_every_micro_batch" in case else 1,
                                                  **case)
        assert not any(name.startswith("gap/gns/data_parallel") for name in metrics), (case, metrics)
        assert any("reduced more than once" in str(w.message) for w in caught), case
        dist.barrier()


@pytest.mark.multiprocess
def test_noise_scale_from_fsdp2_reduction_without_per_sample_norms():
    run_distributed(_fsdp2_reduction_worker, 2)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_noise_scale_from_hsdp_reduction_without_per_sample_norms():
    run_distributed(_fsdp2_reduction_worker, 4)


def test_sample_ids_are_checked_where_they_are_given():
    """sample_ids without per-sample norms, a count that is not the step's, and repeated ids are refused in
    one line each (the noise scale would otherwise count samples wrongly)."""
    model = _net()
    with gapmon.GAPMonitor(model, activations=False, activation_grads=False) as mon:
        with pytest.raises(ValueError, match="per_sample_grad_norms=True"):
            mon.begin_step(0, sample_ids=[1, 2])
    with gapmon.GAPMonitor(model, per_sample_grad_norms=True, activations=False, activation_grads=False) as mon:
        with pytest.raises(ValueError, match="repeat"):
            mon.begin_step(0, sample_ids=[1, 1])
        mon.begin_step(1, sample_ids=[1, 2, 3])
        ids, labels = _batch(3, 2)
        _own_losses(model, ids, labels).mean().backward()
        with pytest.raises(ValueError, match="3 sample ids for the step's 2 samples"):
            mon.end_step()
        mon.begin_step(2)
        with pytest.raises(ValueError, match="got 1 sample ids for 2 samples"):
            mon.add_samples(2, sample_ids=[7])


@pytest.mark.parametrize("layout", ["several", "one", "none"])
def test_fsdp_param_groups_reads_a_list_of_groups_or_a_single_one(monkeypatch, layout):
    """FSDP2's module state holds a list of parameter groups (torch 2.13) or at most one (earlier releases): the noise
    scale's reduction hooks find them either way (torch 2.11, the GPU machines' torch, has the single one)."""
    from types import SimpleNamespace

    import torch.distributed.fsdp as fsdp

    from gapmon._torch_compat import fsdp_param_groups

    class Sharded(torch.nn.Module):
        def __init__(self, state):
            super().__init__()
            self.state = state

        def _get_fsdp_state(self):
            return self.state

    a, b = object(), object()
    state = {"several": SimpleNamespace(_fsdp_param_groups=[a, b]), "one": SimpleNamespace(_fsdp_param_group=a),
             "none": SimpleNamespace(_fsdp_param_group=None)}[layout]
    monkeypatch.setattr(fsdp, "FSDPModule", Sharded)
    model = torch.nn.Sequential(Sharded(state), torch.nn.Linear(2, 2))
    assert fsdp_param_groups(model) == {"several": [a, b], "one": [a], "none": []}[layout]
