"""PerSampleGradNorms(gram=True): per-sample gradient Gram matrices and similarities against the Gram of
per-sample gradients materialised in float64 (a backward per sample; torch.func.vmap(grad(...)) where it applies), over micro-batches, per layer
(Linear in both of its forms, Embedding, LayerNorm, a grouped Conv1d and a GRU by polarisation), with the
norms as the diagonal; float32 within 1e-4; refusals."""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import gapmon
from gapmon.per_sample.rules.linear import product_gram

V, T = 11, 5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 8, padding_idx=0)
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1, groups=2)
        self.rnn = nn.GRU(16, 6, batch_first=True)
        self.head = nn.Linear(6, V)

    def forward(self, ids):
        x = torch.tanh(self.up(self.norm(self.emb(ids))))
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        x, _ = self.rnn(x)
        return self.head(x)


def _model(dtype=torch.float64):
    torch.manual_seed(0)
    return Net().to(dtype)


def _own_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def _per_sample_grads(model, ids, labels):
    """{parameter name: [B, numel]} gradients of each sample's own loss, one backward per sample (torch.func's
    vmap cannot batch a GRU)."""
    names = [n for n, _ in model.named_parameters()]
    rows = []
    for i in range(len(ids)):
        grads = torch.autograd.grad(_own_loss(model(ids[i:i + 1]), labels[i:i + 1]), list(model.parameters()))
        rows.append([g.reshape(-1).double() for g in grads])
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(names)}


def _batches(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, V, (n, T), generator=g), torch.randint(1, V, (n, T), generator=g)) for n in (3, 4)]


def _run(model, batches, **kwargs):
    psn = gapmon.PerSampleGradNorms(model, gram=True, **kwargs)
    for ids, labels in batches:  # two micro-batches, each loss the mean over its samples
        logits = model(ids)
        losses = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(len(ids), -1).mean(1)
        losses.mean().backward()
    return psn


def test_gram_matches_materialised_per_sample_gradients():
    model = _model()
    batches = _batches()
    psn = _run(model, batches)
    ids = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    grads = _per_sample_grads(_model(), ids, labels)
    layers = psn.gram_by_layer()
    assert sorted(layers) == ["conv", "emb", "head", "norm", "rnn", "up"]
    total = torch.zeros(7, 7, dtype=torch.float64)
    for layer, k in layers.items():
        flat = torch.cat([g for n, g in grads.items() if n.split(".")[0] == layer], dim=1)
        want = flat @ flat.T
        torch.testing.assert_close(k, want, rtol=1e-10, atol=1e-12 * want.abs().max().item(), msg=layer)
        total += want
    k = psn.gram()
    torch.testing.assert_close(k, total, rtol=1e-10, atol=1e-12 * total.abs().max().item())
    torch.testing.assert_close(k.diagonal().sqrt(), psn.local_norms().double(), rtol=1e-10, atol=0)
    cos = psn.similarity()
    norms = total.diagonal().sqrt()
    torch.testing.assert_close(cos, total / (norms[:, None] * norms[None, :]), rtol=1e-9, atol=1e-12)


def test_gram_in_float32():
    model = _model(torch.float32)
    batches = _batches()
    psn = _run(model, batches)
    ids = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    grads = _per_sample_grads(_model(), ids, labels)  # float64 reference
    flat = torch.cat(list(grads.values()), dim=1)
    want = flat @ flat.T
    torch.testing.assert_close(psn.gram(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("shape", [(3, 7, 2, 3), (3, 2, 16, 16)], ids=["direct", "ghost"])
def test_linear_product_gram_in_both_forms(shape):
    b, t, d, p = shape
    g = torch.Generator().manual_seed(4)
    a1, a2 = torch.randn(b, t, d, generator=g, dtype=torch.float64), torch.randn(b + 1, t + 1, d, generator=g, dtype=torch.float64)
    g1, g2 = torch.randn(b, t, p, generator=g, dtype=torch.float64), torch.randn(b + 1, t + 1, p, generator=g, dtype=torch.float64)
    w1, w2 = torch.einsum("btp,btd->bpd", g1, a1).reshape(b, -1), torch.einsum("btp,btd->bpd", g2, a2).reshape(b + 1, -1)
    torch.testing.assert_close(product_gram(a1, g1, a2, g2), w1 @ w2.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(product_gram(a1, g1, a2, g2, budget=1), w1 @ w2.T, rtol=1e-12, atol=1e-12)  # one row a chunk


def test_scale_grad_by_freq_embedding():
    torch.manual_seed(1)
    emb = nn.Embedding(6, 4, scale_grad_by_freq=True).double()
    head = nn.Linear(4, 1).double()
    model = nn.Sequential(emb, head)
    ids = torch.tensor([[1, 1, 2, 3], [2, 2, 2, 5], [1, 4, 4, 1]])
    psn = gapmon.PerSampleGradNorms(model, gram=True, loss_reduction="sum")
    model(ids).square().sum().backward()
    params = {n: p.detach() for n, p in model.named_parameters()}
    grads = vmap(grad(lambda p, i: functional_call(model, p, (i.unsqueeze(0),)).square().sum()), in_dims=(None, 0))(params, ids)
    flat = torch.cat([g.reshape(3, -1) for g in grads.values()], dim=1)
    torch.testing.assert_close(psn.gram(), flat @ flat.T, rtol=1e-10, atol=1e-12)


def test_refusals():
    with pytest.raises(ValueError, match="book-keeping"):
        gapmon.PerSampleConfig(gram=True, bookkeeping=True)
    model = _model()
    psn = gapmon.PerSampleGradNorms(model)
    ids, labels = _batches()[0]
    _own_loss(model(ids), labels).backward()
    with pytest.raises(RuntimeError, match="gram=True"):
        psn.gram()


def _global_worker(rank, world):
    """Two ranks, each its own micro-batches, samples 2 and 3 on both (the same ids, the same data): the
    global Gram, ordered by id and each id once, equals the one of the distinct samples."""
    import torch.distributed as dist

    batches = _batches()
    ids = torch.cat([b[0] for b in batches])  # 7 samples: rank 0 holds 0..3, rank 1 holds 2..6
    labels = torch.cat([b[1] for b in batches])
    mine = torch.arange(0, 4) if rank == 0 else torch.arange(2, 7)
    model = nn.parallel.DistributedDataParallel(_model())
    psn = gapmon.PerSampleGradNorms(model, gram=True)
    _own_loss(model(ids[mine]), labels[mine]).backward()  # the mean over the rank's samples and tokens
    got_ids, k = psn.global_gram(mine + 100)
    grads = _per_sample_grads(_model(), ids, labels)
    flat = torch.cat(list(grads.values()), dim=1)
    assert got_ids.tolist() == list(range(100, 107))
    torch.testing.assert_close(k, flat @ flat.T, rtol=1e-10, atol=1e-12 * (flat @ flat.T).abs().max().item())
    dist.barrier()


@pytest.mark.multiprocess
def test_global_gram_over_ranks_with_shared_samples():
    from helpers import run_distributed

    run_distributed(_global_worker, 2)


def test_collected_gradients_equal_per_sample_gradients(tmp_path):
    """PerSampleGradients writes the chosen layers' per-sample gradients (chunks of 2, two micro-batches, in the
    background); load_gradients reads them back checked: equal to the materialised ones; the similarity from the
    files equals the Gram's; a damaged file is refused."""
    from gapmon.dump.format import DumpCorruptError
    from gapmon.per_sample import PerSampleGradients, collected_layers, collected_steps, load_gradients, similarity_from_files

    model = _model()
    batches = _batches()
    with PerSampleGradients(model, tmp_path, layers=("up", "conv", "emb", "rnn"), chunk=2, async_write=True) as coll:
        for step in (3, 4):
            coll.begin_step(step)
            for ids, labels in batches:
                logits = model(ids)
                losses = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(len(ids), -1).mean(1)
                losses.mean().backward()
            coll.end_step(sample_ids=torch.arange(7) * 10)
            model.zero_grad()
    assert collected_steps(tmp_path) == [3, 4] and collected_layers(tmp_path, 4) == ["conv", "emb", "rnn", "up"]
    ids = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    want = _per_sample_grads(_model(), ids, labels)
    for layer in ("up", "conv", "emb", "rnn"):
        got_ids, grads = load_gradients(tmp_path, 3, layer)
        assert got_ids.tolist() == [0, 10, 20, 30, 40, 50, 60]
        for name, g in grads.items():
            torch.testing.assert_close(g.reshape(7, -1), want[name], rtol=1e-10, atol=1e-12, msg=name)
    _, cos = similarity_from_files(tmp_path, 3, "up")
    flat = torch.cat([want[n] for n in want if n.startswith("up.")], dim=1)
    k = flat @ flat.T
    torch.testing.assert_close(cos, k / (k.diagonal().sqrt()[:, None] * k.diagonal().sqrt()[None, :]), rtol=1e-9, atol=1e-12)
    rank_dir = tmp_path / "step00000003" / "rank0"
    manifest = json.loads((rank_dir / "MANIFEST.json").read_text())
    victim = rank_dir / next(f["file"] for f in manifest["files"] if f["layer"] == "up")
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(DumpCorruptError, match="checksum"):
        load_gradients(tmp_path, 3, "up")
    with pytest.raises(ValueError, match="no covered layer matches"):
        PerSampleGradients(_model(), tmp_path, layers=("nothing*",))


class _Seq(nn.Module):
    """A layer on [B, T, C] inputs (conv-family layers on [B, C, T]), then a sum of squares loss."""

    def __init__(self, layer, channels_first=False):
        super().__init__()
        self.layer, self.channels_first = layer, channels_first

    def forward(self, x):
        if self.channels_first:
            return self.layer(x.transpose(1, 2)).transpose(1, 2)
        out = self.layer(x, x, x, need_weights=False)[0] if isinstance(self.layer, nn.MultiheadAttention) else self.layer(x)
        return out[0] if isinstance(out, tuple) else out


class _SelfBilinear(nn.Module):
    """nn.Bilinear of x with itself."""

    def __init__(self, bil):
        super().__init__()
        self.bil = bil

    def forward(self, x):
        return self.bil(x, x)


class _CellSteps(nn.Module):
    """A recurrent cell looped over the steps of [B, T, d]: one layer called T times."""

    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def forward(self, x):
        state, hs = None, []
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
            hs.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(hs, 1)


LAYERS = {
    "linear_no_bias": lambda: _Seq(nn.Linear(6, 4, bias=False)),
    "layernorm": lambda: _Seq(nn.LayerNorm(6)),
    "rmsnorm": lambda: _Seq(nn.RMSNorm(6)),
    "layernorm_two_dims": lambda: _Seq(nn.LayerNorm((5, 6))),  # a [5, 6] weight: the sums take its shape
    "rmsnorm_two_dims": lambda: _Seq(nn.RMSNorm((5, 6))),
    "groupnorm": lambda: _Seq(nn.GroupNorm(2, 6), channels_first=True),
    "conv1d": lambda: _Seq(nn.Conv1d(6, 4, 3, padding=1), channels_first=True),
    "conv_transpose1d": lambda: _Seq(nn.ConvTranspose1d(6, 4, 3, groups=2), channels_first=True),
    "mha": lambda: _Seq(nn.MultiheadAttention(6, 2, batch_first=True)),
    "lstm": lambda: _Seq(nn.LSTM(6, 3, batch_first=True, bidirectional=True)),
    "lstm_projected": lambda: _Seq(nn.LSTM(6, 4, batch_first=True, proj_size=2, num_layers=2)),
    "lstm_cell": lambda: _CellSteps(nn.LSTMCell(6, 3)),
    "prelu": lambda: _Seq(nn.PReLU(6, init=0.3), channels_first=True),
    "bilinear": lambda: _Seq(_SelfBilinear(nn.Bilinear(6, 6, 3))),
    "gru_cell": lambda: _CellSteps(nn.GRUCell(6, 3)),
}


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_materialised_and_gram_per_layer_family(kind):
    """per_sample_gradients() and gram() of each layer family equal a backward per sample (float64)."""
    torch.manual_seed(5)
    model = LAYERS[kind]().double()
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, gram=True, loss_reduction="sum")
    model(x).square().sum().backward()
    psn.pause()  # the reference's own passes below are not samples of the step
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(4):
        grads = torch.autograd.grad(model(x[i:i + 1]).square().sum(), [p for _, p in model.named_parameters()])
        rows.append({n: g.double() for n, g in zip(names, grads)})
    got = {}
    for _layer, _first, _count, grads in psn.per_sample_gradients(chunk=3):
        for name, g in grads.items():
            got.setdefault(name, []).append(g)
    assert sorted(got) == sorted(names), (sorted(got), names)
    for name in names:
        torch.testing.assert_close(torch.cat(got[name]), torch.stack([r[name] for r in rows]), rtol=1e-10, atol=1e-12, msg=name)
    flat = torch.stack([torch.cat([r[n].reshape(-1) for n in names]) for r in rows])
    torch.testing.assert_close(psn.gram(), flat @ flat.T, rtol=1e-10, atol=1e-12 * (flat @ flat.T).abs().max().item())


def test_reference_dots_match_per_sample_gradients():
    """<g_i, g_ref> against a reference gradient (another batch's, through autograd) over every covered layer."""
    model = _model()
    batches = _batches()
    psn = _run(model, batches)
    psn.pause()
    g = torch.Generator().manual_seed(9)
    val_ids, val_labels = torch.randint(0, V, (5, T), generator=g), torch.randint(1, V, (5, T), generator=g)
    names = [n for n, _ in model.named_parameters()]
    ref = dict(zip(names, torch.autograd.grad(_own_loss(model(val_ids), val_labels), list(model.parameters()))))
    got = psn.reference_dots(ref, chunk=2)
    ids = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    grads = _per_sample_grads(_model(), ids, labels)
    want = sum(grads[n] @ ref[n].reshape(-1).double() for n in names)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12 * want.abs().max().item())
    with pytest.raises(ValueError, match="not parameters"):
        psn.reference_dots({"nope.weight": torch.zeros(1)})


def _fsdp2_worker(rank, world, root):
    """FSDP2 wrapped per layer over 2 ranks, each rank its own samples: the global Gram and the collected
    per-sample gradients (each rank writes its own samples of the full layers) equal the per-sample gradients
    of the whole model."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from gapmon.per_sample import PerSampleGradients, load_gradients

    batches = _batches()
    ids = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    mine = torch.arange(0, 3) if rank == 0 else torch.arange(3, 7)
    grads = _per_sample_grads(_model(), ids, labels)
    flat = torch.cat(list(grads.values()), dim=1)

    from helpers import cpu_mesh

    mesh = cpu_mesh(world)  # a GPU machine's default mesh would be a CUDA one
    model = _model()
    for layer in (model.emb, model.norm, model.up, model.conv, model.rnn, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    psn = gapmon.PerSampleGradNorms(model, gram=True)
    _own_loss(model(ids[mine]), labels[mine]).backward()
    got_ids, k = psn.global_gram(mine)
    assert got_ids.tolist() == list(range(7))
    torch.testing.assert_close(k, flat @ flat.T, rtol=1e-10, atol=1e-12 * (flat @ flat.T).abs().max().item())
    psn.close()

    model.zero_grad()
    with PerSampleGradients(model, root, layers=("up", "rnn", "emb"), chunk=2) as coll:
        coll.begin_step(0)
        _own_loss(model(ids[mine]), labels[mine]).backward()
        coll.end_step(sample_ids=mine)
    dist.barrier()
    for layer in ("up", "rnn", "emb"):
        got_ids, got = load_gradients(root, 0, layer)
        assert got_ids.tolist() == list(range(7))
        for name, g in got.items():
            torch.testing.assert_close(g.reshape(7, -1), grads[name], rtol=1e-10, atol=1e-12, msg=name)
    dist.barrier()


@pytest.mark.multiprocess
def test_fsdp2_global_gram_and_collection(tmp_path):
    from helpers import run_distributed

    run_distributed(_fsdp2_worker, 2, str(tmp_path))


def test_a_rewrite_cut_between_its_renames_leaves_the_old_generation(tmp_path):
    """A step written twice: the second generation replaces the first; a crash after the old one was moved
    aside and before the new one was renamed in leaves the old one readable."""
    from gapmon.dump.per_sample_files import RankWriter
    from gapmon.per_sample import load_gradients

    for value in (1.0, 2.0):
        w = RankWriter(tmp_path, 5, 0)
        w.write_chunk("up", 0, torch.tensor([1, 2]), {"up.weight": torch.full((2, 3), value)})
        w.seal()
    assert load_gradients(tmp_path, 5, "up")[1]["up.weight"].unique().tolist() == [2.0]
    final = tmp_path / "step00000005" / "rank0"
    final.rename(final.with_name("rank0.old-123"))  # as if the process died between the two renames
    assert load_gradients(tmp_path, 5, "up")[1]["up.weight"].unique().tolist() == [2.0]


def test_collection_of_a_root_layer(tmp_path):
    """A model that is itself a covered layer (module name ""): collected and read back (files are named by
    the layer's place, not its name)."""
    from gapmon.per_sample import PerSampleGradients, load_gradients

    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with PerSampleGradients(model, tmp_path, chunk=3) as coll:
        assert coll.layers == [""]
        coll.begin_step(0)
        model(x).square().sum(1).mean().backward()  # the mean of the samples' own losses
        coll.end_step()
    ids, grads = load_gradients(tmp_path, 0, "")
    assert ids.tolist() == [0, 1, 2, 3]
    for i in range(4):
        w, = torch.autograd.grad(model(x[i:i + 1]).square().sum(), [model.weight])
        torch.testing.assert_close(grads["weight"][i], w, rtol=1e-10, atol=1e-12)


def test_an_input_buffer_refilled_before_the_gram_is_read_is_refused():
    """A loop that refills its input buffer in place after backward and before reading the Gram would get
    another batch's: refused in one line (the kept positions' in-place versions changed)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    buffer = torch.randn(5, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, gram=True)
    model(buffer).square().mean().backward()
    want = psn.gram()  # read before the refill: fine
    psn2 = gapmon.PerSampleGradNorms(model, gram=True)
    psn.close()
    model(buffer).square().mean().backward()
    buffer.copy_(torch.randn(5, 3, dtype=torch.float64))  # the next batch, into the same buffer
    with pytest.raises(RuntimeError, match="changed in place after backward"):
        psn2.gram()
    with pytest.raises(RuntimeError, match="changed in place after backward"):
        list(psn2.per_sample_gradients())
    assert want.shape == (5, 5)
