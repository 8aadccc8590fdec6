"""The batch dimension by provenance (issue 22, item 3): sequence-first activations with T == B,
the default sequence-first TransformerEncoderLayer, position ids with T == B, extra per-sample
inputs, a reduction over the batch. Each case is exact against a float64 loop (one backward per
sample) over the parameters coverage() lists, or refused with a warning naming the layer."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import loop_per_sample_norms

import gapmon
from gapmon.per_sample.batch_provenance import BatchTracker

BOOKKEEPING = pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])
B = T = 4  # the ambiguous case: a size-based guess takes the sequence for the batch


def _loss(out, y):
    return ((out - y) ** 2).flatten(1).sum(1).mean()


def _run(model, inputs, y, bookkeeping, **kwargs):
    psn = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping, **kwargs)
    try:
        model.zero_grad()
        _loss(model(*inputs), y).backward()
        return psn.local_norms(), psn.coverage()
    finally:
        psn.close()


class _Inputs(nn.Module):
    """Feeds the loop reference's single tensor to a model of several inputs (fixed extras)."""

    def __init__(self, model, extra):
        super().__init__()
        self.model, self.extra = model, extra

    def forward(self, x):
        return self.model(x, *(e[: x.shape[0]] if e.dim() and e.shape[0] == B else e for e in self.extra))


def _reference(model, x, y, cov, extra=()):
    covered = set(cov["covered"])
    if not extra:
        return loop_per_sample_norms(model, _loss, x, y, params=covered)
    # per-sample extras are sliced with x; shared ones (position ids [T]) are not
    norms = []
    for i in range(x.shape[0]):
        args = [e[i:i + 1] if per_sample else e for e, per_sample in extra]
        named = [(n, p) for n, p in model.named_parameters() if n in covered]
        grads = torch.autograd.grad(_loss(model(x[i:i + 1], *args), y[i:i + 1]), [p for _, p in named])
        norms.append(torch.sqrt(sum(g.square().sum() for g in grads)))
    return torch.stack(norms)


def _exact(got, want):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _whole_and_exact(model, x, y, bookkeeping):
    """No warning, every parameter covered, the norms exact against the float64 loop; the coverage."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got, cov = _run(model, (x,), y, bookkeeping)
    assert not cov["uncovered"], cov["uncovered_reasons"]
    _exact(got, _reference(model, x, y, cov))
    return cov


class TransposedLinear(nn.Module):
    """A layer fed sequence-first activations: lin(x.transpose(0, 1))."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, x):  # x [B, T, 5]
        h = self.a(x.transpose(0, 1))  # [T, B, 6]
        return self.b(torch.tanh(self.norm(h))).transpose(0, 1)


class SequenceFirstEncoder(nn.Module):
    """The default (sequence-first) TransformerEncoderLayer inside a batch-first model."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0)
        self.out = nn.Linear(8, 2)

    def forward(self, x):  # [B, T, 3]
        return self.out(self.enc(self.inp(x).transpose(0, 1)).transpose(0, 1))


@BOOKKEEPING
@pytest.mark.parametrize("make, shape", [(TransposedLinear, (B, T, 5)), (SequenceFirstEncoder, (B, T, 3))])
def test_sequence_first_layers_with_t_equal_b_are_exact(make, shape, bookkeeping):
    torch.manual_seed(0)
    model = make().double()
    x = torch.randn(*shape, dtype=torch.float64)
    y = torch.randn(B, T, model(x).shape[-1], dtype=torch.float64)
    got, cov = _run(model, (x,), y, bookkeeping, strict=True)
    assert not cov["uncovered"], cov["uncovered"]
    _exact(got, _reference(model, x, y, cov))


@BOOKKEEPING
def test_a_sequence_first_model_input_needs_batch_dim(bookkeeping):
    """An encoder fed [T, B, E]: with batch_dim=1 exact; by default the batch is taken on dim 0, the
    attention then mixes those 'samples', and every layer from it on is refused by name."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0).double()
    x = torch.randn(T, B + 1, 8, dtype=torch.float64)
    y = torch.randn(T, B + 1, 8, dtype=torch.float64)
    loss = lambda out, t: ((out - t) ** 2).sum((0, 2)).mean()  # noqa: E731  per sample: dim 1
    psn = gapmon.PerSampleGradNorms(enc, batch_dim=1, bookkeeping=bookkeeping, strict=True)
    loss(enc(x), y).backward()
    got, cov = psn.local_norms(), psn.coverage()
    psn.close()
    named = [(n, p) for n, p in enc.named_parameters() if n in cov["covered"]]
    assert len(named) == len(list(enc.parameters()))
    want = []
    for i in range(B + 1):
        grads = torch.autograd.grad(loss(enc(x[:, i:i + 1]), y[:, i:i + 1]), [p for _, p in named])
        want.append(torch.sqrt(sum(g.square().sum() for g in grads)))
    _exact(got, torch.stack(want))
    assert got.shape == (B + 1,)

    with pytest.warns(RuntimeWarning, match="mixes the samples"):
        _, cov = _run(enc, (x,), y, bookkeeping)
    assert "linear1.weight" in cov["uncovered"] and "self_attn.in_proj_weight" in cov["uncovered"]


class PositionsAsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(11, 6), nn.Embedding(T, 6), nn.Linear(6, 3)

    def forward(self, ids, pos):
        return self.head(torch.tanh(self.tok(ids) + self.pos(pos)))


@BOOKKEEPING
def test_position_ids_passed_as_input_with_t_equal_b(bookkeeping):
    """Position ids arange(T) with T == B look like a batch; by provenance they are not one: every sample
    shares them, and the position embedding's output, broadcast over the batch where it is added, is followed there
    (covered, exact). Named as a per-sample input, with one row of positions per sample, it is covered and exact."""
    torch.manual_seed(0)
    model = PositionsAsInput().double()
    ids, y = torch.randint(0, 11, (B, T)), torch.randn(B, T, 3, dtype=torch.float64)
    shared = torch.arange(T)
    got, cov = _run(model, (ids, shared), y, bookkeeping, strict=True)
    assert "pos.weight" in cov["covered"] and "tok.weight" in cov["covered"]
    _exact(got, _reference(model, ids, y, cov, extra=[(shared, False)]))

    rows = torch.arange(T).expand(B, T)
    got, cov = _run(model, (ids, rows), y, bookkeeping, batch_inputs=("ids", "pos"), strict=True)
    assert "pos.weight" in cov["covered"]
    _exact(got, _reference(model, ids, y, cov, extra=[(rows, True)]))


class TimeConditioned(nn.Module):
    """A diffusion-style model: a second per-sample input (the timestep) through its own Linear."""

    def __init__(self):
        super().__init__()
        self.time, self.inp, self.out = nn.Linear(1, 6), nn.Linear(5, 6), nn.Linear(6, 5)

    def forward(self, x, t):
        return self.out(torch.tanh(self.inp(x) + self.time(t[:, None])))


def _time_conditioned():
    torch.manual_seed(0)
    return (TimeConditioned().double(), torch.randn(B, 5, dtype=torch.float64), torch.rand(B, dtype=torch.float64),
            torch.randn(B, 5, dtype=torch.float64))


@BOOKKEEPING
def test_a_second_per_sample_input_is_refused_until_named(bookkeeping):
    model, x, t, y = _time_conditioned()
    with pytest.warns(RuntimeWarning, match="'time' is not per-sample"):
        got, cov = _run(model, (x, t), y, bookkeeping)
    assert "time.weight" in cov["uncovered"]
    _exact(got, _reference(model, x, y, cov, extra=[(t, True)]))
    got, cov = _run(model, (x, t), y, bookkeeping, batch_inputs=(0, "t"), strict=True)
    assert "time.weight" in cov["covered"]
    _exact(got, _reference(model, x, y, cov, extra=[(t, True)]))


class InitialStateProjected(nn.Module):
    """A GRU whose initial state [layers, batch, hidden] is projected from per-sample data (samples on dim 1)."""

    def __init__(self):
        super().__init__()
        self.gru, self.proj, self.head = nn.GRU(4, 6, num_layers=2, batch_first=True), nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x, h0):
        out, _ = self.gru(x, torch.tanh(self.proj(h0)))
        return self.head(out[:, -1])


class SequenceFirstConditioned(nn.Module):
    """Sequence-first activations [T, batch, d] (batch_dim=1) with a per-sample condition [batch, c] (dim 0)."""

    def __init__(self):
        super().__init__()
        self.enc, self.cond, self.head = nn.Linear(4, 8), nn.Linear(3, 8), nn.Linear(8, 3)

    def forward(self, x, cond):
        return self.head(torch.relu(self.enc(x) + self.cond(cond).unsqueeze(0)).mean(0))


def _per_input_reference(model, inputs, dims, y):
    """Each sample's norm over every parameter: one backward per sample, each input narrowed on its own dim."""
    norms = []
    for i in range(y.shape[0]):
        grads = torch.autograd.grad(_loss(model(*[t.narrow(d, i, 1) for t, d in zip(inputs, dims)]), y[i:i + 1]),
                                    list(model.parameters()))
        norms.append(torch.sqrt(sum(g.square().sum() for g in grads)))
    return torch.stack(norms)


@BOOKKEEPING
@pytest.mark.parametrize("form", ["pairs", "dict"])
def test_batch_inputs_name_each_inputs_own_batch_dim(bookkeeping, form):
    """An input whose samples lie on another dim than batch_dim is named with its dim: a recurrent layer's initial
    state [layers, batch, hidden] beside a batch-first input, a per-sample condition [batch, c] beside sequence-first
    activations. Named without its dim, it is refused in one line that says how to name it."""
    torch.manual_seed(0)
    cases = [(InitialStateProjected(), (torch.randn(B + 1, 7, 4), torch.randn(2, B + 1, 5)), (0, 1), 0, ("x", "h0")),
             (SequenceFirstConditioned(), (torch.randn(7, B + 1, 4), torch.randn(B + 1, 3)), (1, 0), 1,
              ("x", "cond"))]
    for model, inputs, dims, batch_dim, names in cases:
        model, inputs = model.double(), [t.double() for t in inputs]
        y = torch.randn(B + 1, 3, dtype=torch.float64)
        named = dict(zip(names, dims)) if form == "dict" else tuple(zip(names, dims))
        got, cov = _run(model, inputs, y, bookkeeping, batch_dim=batch_dim, batch_inputs=named, strict=True)
        assert not cov["uncovered"], cov["uncovered"]
        _exact(got, _per_input_reference(model, inputs, dims, y))
        with pytest.raises(ValueError, match=r"has no dim %d of size 5.*\('x', \('h0', 1\)\)" % batch_dim):
            _run(model, inputs, y, bookkeeping, batch_dim=batch_dim, batch_inputs=names, strict=True)


class DictBatch(nn.Module):
    """model(batch): a dict of per-sample tensors, a timestep among them through its own Linear."""

    def __init__(self):
        super().__init__()
        self.time, self.inp, self.out = nn.Linear(1, 6), nn.Linear(5, 6), nn.Linear(6, 5)

    def forward(self, batch):
        return self.out(torch.tanh(self.inp(batch["x"]) + self.time(batch["t"][:, None])))


@BOOKKEEPING
@pytest.mark.parametrize("named", [None, ("batch",)], ids=["first-argument", "named"])
def test_a_container_argument_holds_the_batch_in_each_of_its_tensors(bookkeeping, named):
    """A forward that takes its batch as one dict (model(batch)): every tensor in it with the first one's number of
    samples is per-sample, as a collated batch (they were refused: 'no tensor input with that dim')."""
    torch.manual_seed(0)
    _, x, t, y = _time_conditioned()
    model = DictBatch().double()
    batch = {"x": x, "t": t, "note": torch.arange(3)}  # a tensor of another size is not taken for a batched one
    got, cov = _run(model, (batch,), y, bookkeeping, strict=True, batch_inputs=named)
    assert not cov["uncovered"]
    want = []
    for i in range(B):
        grads = torch.autograd.grad(_loss(model({"x": x[i:i + 1], "t": t[i:i + 1]}), y[i:i + 1]), list(model.parameters()))
        want.append(torch.sqrt(sum(g.square().sum() for g in grads)))
    _exact(got, torch.stack(want))


@BOOKKEEPING
def test_mark_batched_declares_more_inputs_of_the_running_forward(bookkeeping):
    """What the Hugging Face integration does with a collated batch: a pre-hook after gapmon's marks the timestep."""
    model, x, t, y = _time_conditioned()
    psn = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping, strict=True)
    handle = model.register_forward_pre_hook(lambda module, args: psn.mark_batched(args[1]))
    try:
        _loss(model(x, t), y).backward()
        got, cov = psn.local_norms(), psn.coverage()
    finally:
        handle.remove()
        psn.close()
    assert "time.weight" in cov["covered"]
    _exact(got, _reference(model, x, y, cov, extra=[(t, True)]))


def test_mark_batched_refuses_a_tensor_without_the_samples():
    model = TimeConditioned().double()
    psn = gapmon.PerSampleGradNorms(model)
    handle = model.register_forward_pre_hook(lambda module, args: psn.mark_batched(args[1][:2]))
    try:
        with pytest.raises(ValueError, match=r"mark_batched: \[2\] has no dim 0 of the micro-batch's 4 samples"):
            model(torch.randn(B, 5, dtype=torch.float64), torch.rand(B, dtype=torch.float64))
    finally:
        handle.remove()
        psn.close()


class CentredOverBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.a(x)
        return self.b(h - h.mean(0))


def test_a_layer_after_a_reduction_over_the_batch_is_refused():
    torch.manual_seed(0)
    model = CentredOverBatch().double()
    x, y = torch.randn(B, 5, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="'b' is not per-sample .*mean over the batch dim"):
        _run(model, (x,), y, False, strict=True)


def test_tracker_follows_the_batch_through_common_ops():
    """The rules, op by op, against where the batch really is (x is batched on dim 0, T == B)."""
    from gapmon.per_sample.batch_provenance import Merged

    x = torch.randn(B, T, 8)
    tracker = BatchTracker(B)
    tracker.mark(x, 0)
    lin = nn.Linear(8, 8)
    with tracker:
        cases = {
            "transpose": (x.transpose(0, 1), 1), "permute": (x.permute(1, 2, 0), 2), "mT": (x.mT, 0),
            "split heads": (x.view(B, T, 2, 4).transpose(1, 2), 0), "merged": (x.reshape(B * T, 8), Merged(0, T)),
            "unsqueeze": (x[None], 1), "last token": (x[:, -1], 0), "ellipsis": (x[..., :3], 0),
            "select sample": (x[0], str), "sum over T": (x.sum(1), 0), "mean over B": (x.mean(0), str),
            "softmax": (x.softmax(-1), 0), "softmax over B": (x.softmax(0), str), "linear": (lin(x), 0),
            "attention scores": (x @ x.transpose(1, 2), 0), "contract B": (x[:, 0].T @ x[:, 0], str),
            "einsum": (torch.einsum("btd,bsd->bts", x, x), 0), "einsum sum B": (torch.einsum("btd->td", x), str),
            "cat": (torch.cat([x, x], -1), 0), "cat B": (torch.cat([x, x], 0), str),
            "constant": (torch.zeros_like(x), None), "positions": (torch.arange(T), None),
            "expand positions": (torch.arange(T).expand(B, T), 0), "broadcast add": (x + torch.ones(T, 8), 0),
            "mixed layouts": (x + x.transpose(0, 1), str), "no rule": (torch.cdist(x, x), str),
            "fft over T": (torch.fft.fft(x, dim=1), 0), "fft over B": (torch.fft.fft(x, dim=0), str),
            # F.pad as Dynamo's decomposition calls it between graph breaks (transformers' label shift, compiled)
            "pad T": (F.pad(x, (0, 0, 0, 1)), 0), "aten pad T": (torch.ops.aten.constant_pad_nd.default(x, [0, 0, 0, 1]), 0),
            "aten pad B": (torch.ops.aten.constant_pad_nd.default(x, [0, 0, 0, 0, 0, 1]), str),
        }
    for what, (t, want) in cases.items():
        got = tracker.status(t)
        assert (isinstance(got, str) if want is str else got == want), (what, got)


def test_torchs_aliases_are_followed_as_the_ops_they_name():
    """torch.multiply, subtract, divide, clip, absolute, arctan2, greater, ... (aten tags none of them pointwise): the
    status of the op they name, each in place too; in-place forms aten does not tag (abs_, gt_, copysign_) too."""
    x, c = torch.randn(B, T, 8), torch.rand(T, 8) + 0.5
    tracker = BatchTracker(B)
    tracker.mark(x, 0)
    with tracker:
        outs = [torch.multiply(x, c), torch.subtract(c, x, alpha=2), torch.divide(x, c), torch.true_divide(c, x),
                torch.clip(x, -1, 1), torch.absolute(x), torch.arctan2(x, c), torch.greater(x, c), torch.negative(x),
                torch.fix(x), torch.special.expit(x), torch.arctan(x), torch.less_equal(c, x), torch.not_equal(x, c)]
        for op in ("multiply_", "subtract_", "divide_", "clip_", "absolute_", "arctan_", "abs_", "gt_", "copysign_"):
            y = x.clone()
            outs.append(getattr(y, op)(*((c,) if op in ("multiply_", "subtract_", "divide_", "gt_", "copysign_") else
                                           (-1, 1) if op == "clip_" else ())))
    assert [tracker.status(t) for t in outs] == [0] * len(outs)


@BOOKKEEPING
def test_a_model_that_multiplies_by_torch_multiply_is_exact(bookkeeping):
    """ConvBERT gates its attention with `torch.multiply`: every layer before it was left out (no rule for the alias)."""
    torch.manual_seed(0)

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(5, 6), nn.Linear(5, 6), nn.Linear(6, 3)

        def forward(self, x):
            h = torch.multiply(self.a(x), torch.sigmoid(self.b(x)))
            return self.head(torch.subtract(torch.divide(h, 2.0), torch.clip(h, -0.1, 0.1)))

    model = Gated().double()
    x, y = torch.randn(B, T, 5, dtype=torch.float64), torch.randn(B, T, 3, dtype=torch.float64)
    _whole_and_exact(model, x, y, bookkeeping)


def test_tracker_follows_losses_lookups_and_row_wise_ops_on_merged_rows():
    """A loss reduced over the batch is a sum of the samples' terms (BatchSum), unreduced it keeps the rows; a table
    looked up by each sample's ids is that sample's; topk, scatter and unsqueeze keep rows merged with the batch; a
    view's base keeps its own status."""
    from gapmon.per_sample.batch_provenance import BatchSum, Merged

    x, ids = torch.randn(B, T, 8, requires_grad=True), torch.randint(0, 8, (B, T))
    table = torch.randn(1, 9, 4)
    tracker = BatchTracker(B)
    tracker.mark(x, 0)
    tracker.mark(ids, 0)
    with tracker:
        rows, flat = x.reshape(B * T, 8), ids.reshape(-1)
        view = x[:, :2]
        cases = {
            "cross entropy": (F.cross_entropy(rows, flat), BatchSum), "summed": (F.mse_loss(x, x.detach(), reduction="sum"), BatchSum),
            "per token": (F.cross_entropy(rows, flat, reduction="none"), Merged(0, T)),
            "classes on dim 1": (F.cross_entropy(x.transpose(1, 2), ids, reduction="none"), 0),
            "classes along the batch": (F.cross_entropy(x.permute(1, 0, 2), torch.randint(0, B, (T, 8))), str),
            "looked up": (table[0, ids % 9], 0), "looked up, a slice first": (table[:, ids.T], 2),
            "topk values": (rows.topk(2, dim=-1)[0], Merged(0, T)), "topk indices": (rows.topk(2, dim=-1)[1], Merged(0, T)),
            "scatter": (rows.scatter(1, flat[:, None], 0.0), Merged(0, T)), "scatter over B": (x.scatter(0, ids[:, :, None] % B, 0.0), str),
            "scatter into zeros": (torch.zeros(B, T, 9).scatter(2, ids[:, :, None], x[:, :, :1]), 0),
            "scatter into zeros over B": (torch.zeros(B, T, 9).scatter(0, ids[:, :, None] % B, x[:, :, :1]), str),
            "unsqueeze merged": (rows.unsqueeze(-1), Merged(0, T)), "view's base": (view._base, 0),
        }
    for what, (t, want) in cases.items():
        got = tracker.status(t)
        assert (isinstance(got, str) if want is str else type(got) is BatchSum if want is BatchSum else got == want), (what, got)


def test_a_loss_computed_in_the_forward_keeps_every_layer_covered_and_exact():
    """A model that computes its loss itself (transformers' models given labels: cross entropy over flattened logits,
    a sum over the tokens divided by their count) is a sum of the samples' terms: nothing after it mixes them."""

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin, self.head = nn.Embedding(11, 8), nn.Linear(8, 8), nn.Linear(8, 11)

        def forward(self, ids, labels):
            logits = self.head(torch.tanh(self.lin(self.emb(ids))))
            return F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="sum") / labels.numel()

    torch.manual_seed(0)
    model = WithLoss().double()
    ids, labels = torch.randint(0, 11, (B, T)), torch.randint(0, 11, (B, T))
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    model(ids, labels).backward()
    got, cov = psn.local_norms(), psn.coverage()
    psn.close()
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}
    want = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        F.cross_entropy(model.head(torch.tanh(model.lin(model.emb(ids[i:i + 1])))).reshape(-1, 11), labels[i].reshape(-1),
                        reduction="sum") / labels.numel(), list(model.parameters()))]).norm() for i in range(B)])
    _exact(got, want)


def test_tracker_follows_masks_indexed_by_the_samples_in_order():
    """transformers builds its 4-D attention masks from the 2-D padding mask by `padding_mask[batch_idx, kv_idx]`,
    batch_idx = arange(B)[:, None, None, None]: row b of the result is sample b's (followed: it was lost, and with it
    every layer after the mask); an index that reorders or repeats the samples, or is batched itself, loses it."""
    mask = torch.ones(B, T, dtype=torch.bool)
    tracker = BatchTracker(B)
    tracker.mark(mask, 0)
    samples, keys = torch.arange(B), torch.arange(T)
    with tracker:
        cases = {
            "in order": (mask[samples[:, None, None, None], keys[None, None, None, :]], 0),
            "in order, on dim 1": (mask[samples[None, :, None], keys[None, None, :]], 1),
            "one dim each": (mask[samples[:, None], keys[None, :]], 0),
            "reversed": (mask[samples.flip(0)[:, None], keys[None, :]], str),
            "repeated": (mask[torch.zeros(B, dtype=torch.long)[:, None], keys[None, :]], str),
            "too few": (mask[samples[:2, None], keys[None, :]], str),
            "by its own batched index": (mask[samples[:, None], mask.long()], 0),
            "each sample's own position": (mask[samples, mask.long().argmax(-1)], 0),  # CLIP's end-of-text pick
            "a position batched across": (mask[samples[:, None], mask.long().argmax(-1)[None, :]], str),
        }
    for what, (t, want) in cases.items():
        got = tracker.status(t)
        assert (isinstance(got, str) if want is str else got == want), (what, got)


def test_tracker_follows_rows_picked_and_written_back_by_the_samples_in_order():
    """Longformer's global tokens: `h[pos_idx, batch_idx]` picks one row per sample, `g[local_idx, batch_idx] = rows`
    writes them into a fresh tensor, `out[batch_idx, :, local_idx]` picks them again across a whole slice: each
    sample's row in its own place (followed: the write lost the batch, and with it every layer of Longformer's
    classifier); an index that writes the samples out of order, or rows laid out unlike the index, loses it."""
    h = torch.randn(T, B, 8)  # sequence first, as Longformer's attention
    out = torch.randn(B, 2, 3, 4)
    tracker = BatchTracker(B)
    tracker.mark(h, 1)
    tracker.mark(out, 0)
    samples, positions, slots = torch.arange(B), torch.randint(0, T, (B,)), torch.zeros(B, dtype=torch.long)
    with tracker:
        rows = h[positions, samples]
        written = h.new_zeros(1, B, 8)
        written[slots, samples] = rows
        reversed_ = h.new_zeros(1, B, 8)
        reversed_[slots, samples.flip(0)] = rows
        kept = h.new_zeros(T, B, 8)  # rows written back into a batched tensor on its batch dim
        kept[positions, samples] = rows
        cases = {
            "picked": (rows, 0), "written": (written, 1), "written reversed": (reversed_, str), "written back": (kept, 1),
            "picked across a slice": (out[samples, :, slots], 0),
            "picked across a slice, reversed": (out[samples.flip(0), :, slots], str),
        }
    for what, (t, want) in cases.items():
        got = tracker.status(t)
        assert (isinstance(got, str) if want is str else got == want), (what, got)


@BOOKKEEPING
@pytest.mark.parametrize("change", ["divided", "scaled", "added", "read first"])
def test_a_layer_output_changed_in_place_is_exact(change, bookkeeping):
    """F.linear's output for a 3-D input is a view of its 2-D product, and a hook on a view is dropped when the view is
    changed in place (Longformer's `q /= sqrt(d)`): the layer was left out as if its forward had never run."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 3)

        def forward(self, x):
            h = self.a(x)
            before = h * 1.5 if change == "read first" else 0.0
            if change in ("divided", "read first"):
                h /= 2.0
            elif change == "scaled":
                h.mul_(torch.linspace(0.5, 2.0, 6, dtype=h.dtype))
            else:
                h.add_(1.0)
            return self.b(torch.tanh(h) + before)

    model = Model().double()
    x, y = torch.randn(B, T, 5, dtype=torch.float64), torch.randn(B, T, 3, dtype=torch.float64)
    _whole_and_exact(model, x, y, bookkeeping)


def test_tracker_follows_samples_unbound_then_joined_and_scattered():
    """LLaVA's image features: `list(features)` unbinds the batch (each tensor one sample's), `torch.cat(..., 0)` joins
    them in order (the batch merged with the patches again), `embeds.masked_scatter(image_mask, features)` puts them
    at the image tokens: followed where every sample's row takes its own features (it was lost at the unbind, and
    every layer after with it); joined out of order, or scattered where samples take different counts, lost."""
    from gapmon.per_sample.batch_provenance import Merged

    features, embeds = torch.randn(B, 3, 8), torch.randn(B, T + 3, 8)
    mask = torch.zeros(B, T + 3, 1, dtype=torch.bool)
    mask[:, 1:4] = True
    uneven = mask.clone()
    uneven[0, 4] = True
    tracker = BatchTracker(B)
    for t in (features, embeds, mask, uneven):
        tracker.mark(t, 0)
    with tracker:
        pieces = list(features)
        joined = torch.cat(pieces, 0)
        cases = {
            "one sample's": (pieces[1], str), "joined": (joined, Merged(0, 3)), "stacked": (torch.stack(pieces, 0), 0),
            "joined along features": (torch.cat(pieces, -1), Merged(1, 8)),
            "out of order": (torch.cat(pieces[::-1], 0), str), "some": (torch.cat(pieces[:2], 0), str),
            "scattered": (embeds.masked_scatter(mask, joined), 0),
            "scattered from a batch": (embeds.masked_scatter(mask, features), 0),
            "uneven": (embeds.masked_scatter(uneven, torch.cat([joined, joined[:1]], 0)), str),
        }
    for what, (t, want) in cases.items():
        got = tracker.status(t)
        assert (isinstance(got, str) if want is str else got == want), (what, got)


class TwoTowers(nn.Module):
    """A contrastive model: each sample's two views embedded by a tower each, their similarities over every pair of
    samples (`a @ b.T`, CLIP's logits)."""

    def __init__(self, einsum: bool = False):
        super().__init__()
        self.left, self.right, self.einsum = nn.Linear(6, 4), nn.Linear(6, 4), einsum

    def forward(self, x, y):
        a, b = self.left(x), self.right(y)
        return a, b, torch.einsum("id,jd->ij", a, b) if self.einsum else a @ b.T


@pytest.mark.parametrize("loss", ["contrastive", "einsum", "per sample"])
def test_a_loss_over_pairs_of_samples_is_refused(loss):
    """A contrastive loss (cross entropy over the similarities of every pair of samples) has no per-sample gradients of
    each sample's own loss (alone, a sample's loss is a constant): its norms were numbers of no meaning; now refused,
    naming the product. The same model with a loss of each sample's own embeddings computes the similarities too
    (no gradient through them): exact. (The similarities are formed in the model's forward, where the batch is
    followed, as CLIP's are; a loss function that forms them outside it is the user's own.)"""
    torch.manual_seed(0)
    model = TwoTowers(einsum=loss == "einsum").double()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", batch_inputs=(0, 1))

    def loss_of(xs, ys):
        a, b, sim = model(xs, ys)
        if loss != "per sample":
            return nn.functional.cross_entropy(sim, torch.arange(xs.shape[0]), reduction="sum")
        return (a * b).sum() + a.square().sum()

    loss_of(x, y).backward()
    if loss != "per sample":
        with pytest.raises(RuntimeError, match=r"multiplies two samples' tensors together, and the loss depends on"):
            psn.local_norms()
        psn.close()
        return
    got = psn.local_norms()
    psn.close()
    want = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss_of(x[i:i + 1], y[i:i + 1]),
                                                                              list(model.parameters()))]).norm()
                        for i in range(4)])
    _exact(got, want)


class BatchStatistics(nn.Module):
    """A layer, then what the forward does with the whole batch (`how`), then a head: a batch norm written by hand
    (x - mean) / std over the batch, the batch centred on its mean, a penalty on the batch mean added to each sample's output, a softmax along the
    batch; or what a loss inside the forward does that stays a sum of per-sample terms (a token sum divided by the
    batch's count of tokens, which has no gradient), or a maximum over the batch without a gradient."""

    def __init__(self, how: str):
        super().__init__()
        self.inp, self.head, self.how = nn.Linear(5, 6), nn.Linear(6, 3), how

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        if self.how == "batch norm":
            h = (h - h.mean(0)) / h.std(0)
        elif self.how == "centred on the batch mean":  # linear, but each row's gradient goes to every sample's
            h = h - h.mean(0)
        elif self.how == "scaled by the batch's maximum":  # one sample's value for all (Nystromformer's pseudo-inverse)
            h = h / h.abs().amax(0)
        elif self.how == "less the batch's maximum":  # the same through torch.max's (values, indices)
            h = h - torch.max(h, 0).values
        elif self.how == "softmax over the batch":
            h = h * h.softmax(0)
        elif self.how == "functional batch norm":  # the batch's statistics, in a module no BatchNorm hook sees
            h = F.batch_norm(h, None, None, training=True)
        elif self.how == "functional batch norm, running statistics":
            h = F.batch_norm(h, torch.full((6,), 0.1, dtype=h.dtype), torch.full((6,), 2.0, dtype=h.dtype))
        out = self.head(h)
        terms = (out - y).square()
        if self.how == "penalty on the batch mean":
            return terms.sum() + out.mean(0).square().sum()
        if self.how == "token count":
            return terms.sum() / (x.abs() > 0).sum()
        if self.how == "max without gradient":
            return terms.sum() / x.detach().abs().amax(0).sum()
        return terms.sum()


@pytest.mark.parametrize("how", ["batch norm", "softmax over the batch", "penalty on the batch mean",
                                 "functional batch norm", "centred on the batch mean", "scaled by the batch's maximum",
                                 "less the batch's maximum", "token count", "max without gradient",
                                 "functional batch norm, running statistics"])
def test_a_statistic_of_the_whole_batch_in_the_loss_is_refused(how):
    """A loss that depends on a statistic of the whole batch other than through a sum of per-sample terms has no
    per-sample gradients of each sample's own loss: refused, naming it (the layers before it got gradients mixed over
    the samples, and their norms were numbers of no meaning). A sum of per-sample terms scaled by a count of the batch
    with no gradient stays exact (the norms are of each sample's term of that loss)."""
    torch.manual_seed(0)
    model = BatchStatistics(how).double()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", batch_inputs=(0, 1))
    model(x, y).backward()
    if how in ("batch norm", "softmax over the batch", "penalty on the batch mean", "functional batch norm",
               "centred on the batch mean", "scaled by the batch's maximum", "less the batch's maximum"):
        with pytest.raises(RuntimeError, match=r"forms a statistic of the whole batch, and the loss depends on it"):
            psn.local_norms()
        psn.close()
        return
    got = psn.local_norms()
    psn.close()
    scale = {"token count": float((x.abs() > 0).sum()), "max without gradient": float(x.abs().amax(0).sum())}.get(how, 1.0)
    norm = (lambda h: (h - 0.1) / (2.0 + 1e-5) ** 0.5) if how.endswith("running statistics") else (lambda h: h)
    want = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        (model.head(norm(torch.tanh(model.inp(x[i:i + 1])))) - y[i:i + 1]).square().sum() / scale,
        list(model.parameters()))]).norm() for i in range(4)])
    _exact(got, want)


class FourierMixer(nn.Module):
    """FNet's token mixing: the real part of a 2-D FFT over the sequence and the features (`dim`), or of an FFT along
    the batch (`dim=0`: each output row mixes every sample)."""

    def __init__(self, dim):
        super().__init__()
        self.inp, self.head, self.dim = nn.Linear(4, 6), nn.Linear(6, 4), dim

    def forward(self, x):
        h = self.inp(x)
        mixed = torch.fft.fftn(h, dim=self.dim).real if isinstance(self.dim, tuple) else torch.fft.fft(h, dim=0).real
        return self.head(h + mixed)


@BOOKKEEPING
def test_an_fft_over_each_samples_positions_is_exact_and_one_over_the_batch_refused(bookkeeping):
    cov = _strictly_exact(lambda: FourierMixer((1, 2)), 5, bookkeeping)
    assert set(cov["covered"]) == {"inp.weight", "inp.bias", "head.weight", "head.bias"}
    torch.manual_seed(0)
    model = FourierMixer(0).double()
    x, y = torch.randn(B, 5, 4, dtype=torch.float64), torch.randn(B, 5, 4, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (head: its input lost the batch)
        ((model(x) - y) ** 2).sum().backward()
    with pytest.raises(RuntimeError, match=r"forms a statistic of the whole batch.*fft_fft along the batch dim"):
        psn.local_norms()
    psn.close()


def test_tracker_keeps_a_sum_over_the_batch_through_linear_ops_only():
    from gapmon.per_sample.batch_provenance import BatchSum

    tracker = BatchTracker(B)
    x = torch.randn(B, 3, requires_grad=True)
    counts = torch.ones(B, 3)
    tracker.mark(x, 0)
    tracker.mark(counts, 0)
    with tracker:
        total, count = x.sum(), counts.sum()
        kept = {"scaled": (total * 2 - 1) / count, "added": total + x.mean(), "viewed": total.reshape(1)[0],
                "a constant's power": count.square() * total}
        mixed = {"squared": total.square(), "a product of two": total * x.mean(), "divided by one": count / total,
                 "a variance over the batch": x.var(0), "a softmax along it": x.softmax(0),
                 "an fft along it": torch.fft.fft(x, dim=0)}
        per_sample = total + x  # a sum added to every sample's row: the batch is lost there (not kept as a sum)
        picked = {"reordered": x.index_select(0, torch.tensor([2, 0, 1, 3])), "flipped": x.flip(0),
                  "a max over the batch": x.amax(0), "sorted along it": x.sort(0).values}
    assert all(type(tracker.status(t)) is BatchSum for t in kept.values()), {k: tracker.status(t) for k, t in kept.items()}
    for what, t in mixed.items():
        status = tracker.status(t)
        assert isinstance(status, str) and type(status) is not BatchSum and "picks" not in status, (what, status)
    assert isinstance(tracker.status(per_sample), str) and type(tracker.status(per_sample)) is not BatchSum
    # picking or moving samples loses the batch there without mixing them: no gradient is watched on those
    assert all("picks" in tracker.status(t) or "moves" in tracker.status(t) for t in picked.values()), picked


def test_tracker_follows_a_batch_of_one_sample_through_unsqueeze_and_squeeze():
    """With one sample every size-1 dim could be the batch by sizes alone: unsqueeze and squeeze say where it goes
    ([1, 5].unsqueeze(0) has it on dim 1, which a repeat over dim 0 must not take for copied samples)."""
    x = torch.randn(1, 6, 4)
    tracker = BatchTracker(1)
    tracker.mark(x, 0)
    with tracker:
        first = x[:, 0]
        cases = {
            "unsqueeze(0)": (first.unsqueeze(0), 1), "torch.unsqueeze(-1)": (torch.unsqueeze(first, -1), 0),
            "repeat of layers": (first.unsqueeze(0).repeat(2, 1, 1), 1), "squeeze(-1)": (x[..., :1].squeeze(-1), 0),
            "squeeze of dims before": (x.unsqueeze(0).unsqueeze(0).squeeze((0, 1)), 0),
            "squeeze of a later dim": (x[:, :1].squeeze(1), 0), "squeeze()": (x.squeeze(), str),
            "squeeze(0)": (x.squeeze(0), str), "in place": (x.clone().unsqueeze_(0), 1),
        }
    for what, (t, want) in cases.items():
        got = tracker.status(t)
        assert (isinstance(got, str) if want is str else got == want), (what, got)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_recurrent_layer_with_an_initial_state_from_the_batch_is_exact(batch):
    """h0 [layers, B, H] made from the batch (unsqueeze, repeat over the layers): with one sample too."""
    class WithState(nn.Module):
        def __init__(self):
            super().__init__()
            self.init, self.rnn, self.head = nn.Linear(4, 5), nn.GRU(4, 5, num_layers=2, batch_first=True), nn.Linear(5, 3)

        def forward(self, x):
            h0 = torch.tanh(self.init(x[:, 0])).unsqueeze(0).repeat(2, 1, 1)
            out, last = self.rnn(x, h0)
            return self.head(out[:, -1] + last[-1])

    torch.manual_seed(0)
    model = WithState().double()
    x, y = torch.randn(batch, 6, 4, dtype=torch.float64), torch.randn(batch, 3, dtype=torch.float64)
    got, cov = _run(model, (x,), y, False, strict=True)
    assert len(cov["covered"]) == 12
    want = loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"]))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class _TokenTypes(nn.Module):
    """Token types the model makes when none are given (SqueezeBERT's, MobileBERT's, LayoutLM's: zeros of the batch's
    shape, no sample's data in them), looked up by an Embedding; LayoutLM's box embeddings look one table up twice.
    `use`: how the looked-up rows join the batch."""

    def __init__(self, use):
        super().__init__()
        self.tok, self.types, self.head = nn.Embedding(11, 4), nn.Embedding(3, 4), nn.Linear(4, 3)
        self.use = use

    def forward(self, ids):
        types = torch.zeros(ids.shape, dtype=torch.long)
        h = self.tok(ids)
        if self.use == "added":
            h = h + self.types(types)
        elif self.use == "twice":  # two lookups of one table, both added
            h = h + self.types(types) - self.types(types + 1)
        elif self.use == "added first":  # the rows first, the batch added to them
            h = self.types(types) + h
        else:  # flipped: each sample's rows moved to another sample's
            h = h + self.types(types).flip(0)
        return self.head(torch.tanh(h))


@BOOKKEEPING
@pytest.mark.parametrize("use", ["added", "twice", "added first"])
def test_token_types_the_model_makes_are_exact(use, bookkeeping):
    torch.manual_seed(0)
    model = _TokenTypes(use).double()
    ids, y = torch.randint(0, 11, (B, T)), torch.randn(B, T, 3, dtype=torch.float64)
    assert "types.weight" in _whole_and_exact(model, ids, y, bookkeeping)["covered"]


def test_token_types_moved_between_samples_are_left_out_named():
    torch.manual_seed(0)
    model = _TokenTypes("flipped").double()
    ids, y = torch.randint(0, 11, (B, T)), torch.randn(B, T, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="layer 'types' is not per-sample"):
        got, cov = _run(model, (ids,), y, False)
    assert "types.weight" in cov["uncovered"] and {"tok.weight", "head.weight"} <= set(cov["covered"])
    _exact(got, _reference(model, ids, y, cov))


@pytest.mark.parametrize("dims", [1, (1,), [1, 2]], ids=["int", "tuple", "list"])
def test_shared_positions_flipped_are_exact(dims):
    """`p.flip(1)` of a shared output (the method takes an int; torch.flip wants a sequence): its elements followed
    to where they sit (an int raised TypeError inside the tracking, and every layer it reached was left out)."""
    class Flipped(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos, self.head = nn.Embedding(11, 4), nn.Embedding(T, 4), nn.Linear(4, 3)

        def forward(self, ids):
            flipped = self.pos(torch.arange(ids.shape[1])[None]).flip(*(dims if isinstance(dims, tuple) else (dims,)))
            return self.head(torch.tanh(self.tok(ids) + flipped))

    torch.manual_seed(0)
    model = Flipped().double()
    ids, y = torch.randint(0, 11, (B, T)), torch.randn(B, T, 3, dtype=torch.float64)
    got, cov = _run(model, (ids,), y, False, strict=True)
    assert "pos.weight" in cov["covered"]
    _exact(got, _reference(model, ids, y, cov))


class _ExpandedPositions(nn.Module):
    """MPNet's way: the shared positions' output (permuted, unsqueezed) expanded over the batch, made contiguous, then
    added; `reshaped`: the expansion flattened with the batch before the add (not followed)."""

    def __init__(self, reshaped=False):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(11, 4), nn.Embedding(T, 4), nn.Linear(4, 3)
        self.reshaped = reshaped

    def forward(self, ids):
        b, t = ids.shape
        p = self.pos(torch.arange(t)).permute(1, 0).t().unsqueeze(0).expand(b, -1, -1).contiguous()
        h = self.tok(ids)
        if self.reshaped:
            h = (h.reshape(b * t, 4) + p.reshape(b * t, 4)).view(b, t, 4)
        else:
            h = h + p
        return self.head(torch.tanh(h))


@BOOKKEEPING
def test_shared_positions_expanded_over_the_batch_are_exact(bookkeeping):
    torch.manual_seed(0)
    model = _ExpandedPositions().double()
    ids, y = torch.randint(0, 11, (B, T)), torch.randn(B, T, 3, dtype=torch.float64)
    got, cov = _run(model, (ids,), y, bookkeeping, strict=True)
    assert "pos.weight" in cov["covered"]
    _exact(got, _reference(model, ids, y, cov))


def test_shared_positions_expanded_then_merged_with_the_batch_are_left_out_named():
    torch.manual_seed(0)
    model = _ExpandedPositions(reshaped=True).double()
    ids, y = torch.randint(0, 11, (B, T)), torch.randn(B, T, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="layer 'pos' is not per-sample"):
        got, cov = _run(model, (ids,), y, False)
    assert "pos.weight" in cov["uncovered"] and {"tok.weight", "head.weight"} <= set(cov["covered"])
    _exact(got, _reference(model, ids, y, cov))


class _Positions(nn.Module):
    """Token embeddings plus position embeddings of ids [1, T] every sample shares (GPT-2's wpe, BERT's), added (or
    added in place, or subtracted) to the batch; `extra` uses the position output once more."""

    def __init__(self, join="add", extra=None):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(11, 4), nn.Embedding(6, 4), nn.Linear(4, 3)
        self.join, self.extra = join, extra

    def forward(self, ids):
        h, p = self.tok(ids), self.pos(torch.arange(ids.shape[1])[None]).to(torch.float64)
        if self.join == "add":
            h = h + p
        elif self.join == "in place":
            h += p
        else:
            h = h - p
        if self.extra == "scaled":
            h = h + 0.5 * p  # a use that is not a plain add (followed through its vector-Jacobian product)
        elif self.extra == "pooled":
            h = h + p.mean()  # a use that reduces it (the same)
        elif self.extra == "stack":
            h = torch.stack([h, p.expand_as(h)], -1).amax(-1)  # where it meets the batch, an op no rule reads
        return self.head(torch.tanh(h))


def test_a_nan_gradient_through_shared_positions_leaves_the_users_backward_alone():
    """A loss whose gradient is NaN (a model's own overflow, CANINE's tiny configuration) reaches the shared position
    embedding's check as NaN: the backward ran into gapmon's tolerance (`atol ... got -nan`) and raised; now it
    completes and the norms carry the NaN, as the model's gradients do."""
    torch.manual_seed(0)
    model = _Positions().double()
    ids = torch.randint(0, 11, (3, 5))
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    (model(ids).sum() * float("nan")).backward()
    got = psn.local_norms()
    psn.close()
    assert got.shape == (3,) and torch.isnan(got).all()
    assert torch.isnan(model.pos.weight.grad[:5]).all()  # (the table's last row is no position here)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("join", ["add", "in place", "subtracted"])
def test_position_ids_shared_by_every_sample_are_exact(batch, join):
    """Autograd sums the position embedding's output gradient over the samples; the gradient of the sum it joins
    still holds each sample's: read there, checked against the output's own, exact."""
    torch.manual_seed(0)
    model = _Positions(join).double()
    ids, y = torch.randint(0, 11, (batch, 6)), torch.randn(batch, 6, 3, dtype=torch.float64)
    got, cov = _run(model, (ids,), y, False, strict=True)
    assert "pos.weight" in cov["covered"]
    want = loop_per_sample_norms(model, _loss, ids, y, params=set(cov["covered"]))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_shared_position_ids_recomputed_by_activation_checkpointing_are_exact():
    """Non-reentrant checkpointing recomputes the embeddings in backward (outside the forward pass): the calls the
    forward pass recorded, shared ones too, stand; the recomputed ones are not taken for new calls."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(_Positions):
        def embed(self, ids):
            h = self.tok(ids) + self.pos(torch.arange(ids.shape[1])[None])
            return h * h.tanh()  # saves h: the recomputation runs both embeddings again

        def forward(self, ids):
            return self.head(checkpoint(self.embed, ids, use_reentrant=False))

    torch.manual_seed(0)
    model = Checkpointed().double()
    ids, y = torch.randint(0, 11, (3, 6)), torch.randn(3, 6, 3, dtype=torch.float64)
    got, cov = _run(model, (ids,), y, False, strict=True)
    assert {"tok.weight", "pos.weight"} <= set(cov["covered"])
    _exact(got, loop_per_sample_norms(model, _loss, ids, y, params=set(cov["covered"])))


@pytest.mark.parametrize("extra", ["scaled", "pooled"])
def test_a_shared_output_scaled_or_reduced_before_another_add_is_exact(extra):
    """`0.5 * p`, `p.mean()`: ops of the shared output alone, followed through their vector-Jacobian products to where
    they are added to the batch (followed_through)."""
    torch.manual_seed(0)
    model = _Positions("add", extra).double()
    ids, y = torch.randint(0, 11, (3, 6)), torch.randn(3, 6, 3, dtype=torch.float64)
    got, cov = _run(model, (ids,), y, False, strict=True)
    assert "pos.weight" in cov["covered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, ids, y), rtol=1e-10, atol=1e-12)


def test_a_shared_output_used_besides_its_add_is_left_out():
    """The shared output meets the batch in an op no rule reads (a stack): its per-sample gradient cannot be read, so the
    layer is left out by name (the rest exact)."""
    torch.manual_seed(0)
    model = _Positions("add", "stack").double()
    ids, y = torch.randint(0, 11, (3, 6)), torch.randn(3, 6, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="'pos' is not per-sample .*shared by every sample"):
        got, cov = _run(model, (ids,), y, False)
    assert "pos.weight" not in cov["covered"]
    want = loop_per_sample_norms(model, _loss, ids, y, params=set(cov["covered"]))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_shared_output_that_stops_being_added_mid_step_is_left_out():
    """Added to the batch in the first micro-batch (its norms added), used otherwise in the second: it is left out,
    named, and what the first micro-batch added taken back out, so the step's norms are the rest's, exact (they were
    refused); strict=True refuses. It stays left out from then on."""
    torch.manual_seed(0)
    model = _Positions("add").double()
    ids, y = torch.randint(0, 11, (3, 6)), torch.randn(3, 6, 3, dtype=torch.float64)

    def step(psn, extras):
        for extra in extras:
            model.extra = extra
            _loss(model(ids), y).backward()

    psn = gapmon.PerSampleGradNorms(model, strict=True)
    step(psn, (None, "stack"))
    with pytest.raises(RuntimeError, match="'pos' is not per-sample"):
        psn.local_norms()
    psn.close()
    psn = gapmon.PerSampleGradNorms(model)
    step(psn, (None, "stack"))
    with pytest.warns(RuntimeWarning, match="'pos' is not per-sample"):
        got = psn.local_norms()
    step(psn, (None,))  # the next step: still left out
    then, covered = psn.local_norms(), set(psn.coverage()["covered"])
    psn.close()
    assert "pos.weight" not in covered
    want = []
    for extra in (None, "stack"):
        model.extra = extra
        want.append(loop_per_sample_norms(model, _loss, ids, y, params=covered))
    _exact(got, torch.cat(want))
    _exact(then, want[0])


def test_type_as_takes_the_status_of_its_first_input_only():
    """x.type_as(batched) holds x's values: unbatched when x is (the hot path for pointwise ops must not take
    the status of the tensor that only gives the dtype)."""
    from gapmon.per_sample.batch_provenance import BatchTracker

    batch = torch.randn(4, 3)
    constant = torch.ones(4, 3, dtype=torch.float64)
    tracker = BatchTracker(4)
    tracker.mark(batch, 0)
    with tracker:
        for _ in range(2):  # the second time, the op's kind is known: the hot path decides
            same_dtype = constant.type_as(batch)
            summed = batch + batch * 2
            assert tracker.status(same_dtype) is None and tracker.status(summed) == 0


class ShiftedIds(nn.Module):
    """T5's and BART's decoder inputs: `shifted = ids.new_zeros(ids.shape); shifted[..., 1:] = ids[..., :-1]`, the
    batched ids written into a fresh tensor; `alias` reads them through a view of it taken before the write."""

    def __init__(self, alias: bool = False):
        super().__init__()
        self.emb, self.head, self.alias = nn.Embedding(11, 6), nn.Linear(6, 5), alias

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        view = shifted[:, 1:] if self.alias else None
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[..., 0] = 3  # the start token, every sample's
        return self.head(self.emb(shifted if view is None else view))


@BOOKKEEPING
def test_batched_values_written_into_a_fresh_tensor_keep_the_batch(bookkeeping):
    torch.manual_seed(0)
    model = ShiftedIds().double()
    ids, y = torch.randint(0, 11, (B, 7)), torch.randn(B, 7, 5, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing left out
        got, cov = _run(model, (ids,), y, bookkeeping)
    assert set(cov["covered"]) == {"emb.weight", "head.weight", "head.bias"}
    _exact(got, _reference(model, ids, y, cov))


def test_batched_values_read_through_a_view_taken_before_the_write_are_not_followed():
    """A view taken before the write keeps the status it had (none): the layers reading it are left out, named."""
    torch.manual_seed(0)
    model = ShiftedIds(alias=True).double()
    ids, y = torch.randint(0, 11, (B, 7)), torch.randn(B, 6, 5, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="'head' is not per-sample"):
        got, cov = _run(model, (ids,), y, False)
    assert set(cov["uncovered"]) == {"emb.weight", "head.weight", "head.bias"}
    assert got.shape == (B,)


class SharedThroughALayer(nn.Module):
    """Something every sample shares (an embedding of position ids, or a parameter of the model) run through a
    Linear before it joins the batch."""

    def __init__(self, shared: str):
        super().__init__()
        self.inp, self.proj, self.shared = nn.Linear(6, 6), nn.Linear(6, 6), shared
        self.pos = nn.Embedding(7, 6) if shared == "position embedding" else None
        self.query = nn.Parameter(torch.randn(1, 7, 6)) if shared == "parameter" else None

    def forward(self, x):
        s = self.pos(torch.arange(x.shape[1])[None]) if self.pos is not None else self.query
        return self.inp(x) + self.proj(s)


@pytest.mark.parametrize("shared", ["position embedding", "parameter"])
@BOOKKEEPING
def test_a_shared_tensor_run_through_a_layer_before_it_joins_the_batch_is_exact(shared, bookkeeping):
    """The layer's call is followed as one every sample shares (its output joins the batch in the add), and each
    sample's gradient of its input, g W, goes back to what made it (the embedding's call, the parameter). (They were
    left out by name; gapmon raised TypeError inside the user's forward pass here before that.)"""
    torch.manual_seed(0)
    model = SharedThroughALayer(shared).double()
    x, y = torch.randn(B, 7, 6, dtype=torch.float64), torch.randn(B, 7, 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got, cov = _run(model, (x,), y, bookkeeping)
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}
    _exact(got, _reference(model, x, y, cov))


@pytest.mark.parametrize("write, why", [("x[:2] = y[:2]", "selects samples"), ("x[0] = y.sum(0)", "indexed assignment")])
def test_batched_values_written_over_some_samples_lose_the_batch(write, why):
    tracker = BatchTracker(B)
    y = torch.randn(B, 3)
    tracker.mark(y, 0)
    with tracker:
        x = torch.zeros(B, 3)
        exec(write)
    status = tracker.status(x)
    assert isinstance(status, str) or status is None, status


class WindowAttention(nn.Module):
    """Swin's layout: the batch merged with its windows into dim 0 ([B·W, heads, N, d]) for attention in each window,
    with a mask every sample shares."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.proj = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):  # x [B, 2 windows · 3 tokens, 4]
        b = x.shape[0]
        windows = x.view(b, 2, 3, 4).reshape(b * 2, 3, 4)  # (window_partition: split, then merge)
        q, k, v = (layer(windows).view(b * 2, 3, 2, 2).transpose(1, 2) for layer in (self.q, self.k, self.v))
        mask = torch.tensor([[0.0, -1.0, 0.5]], dtype=x.dtype).expand(3, 3)  # every sample's
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, 2, 3, 4).reshape(b, 6, 4))


def _strictly_exact(make, t: int, bookkeeping: bool) -> dict:
    """The coverage of make()'s norms on [B, t, 4] inputs, with strict=True, checked exact."""
    torch.manual_seed(0)
    model = make().double()
    x, y = torch.randn(B, t, 4, dtype=torch.float64), torch.randn(B, t, 4, dtype=torch.float64)
    got, cov = _run(model, (x,), y, bookkeeping, strict=True)
    _exact(got, _reference(model, x, y, cov))
    return cov


@BOOKKEEPING
def test_attention_within_windows_merged_with_the_batch_is_exact(bookkeeping):
    cov = _strictly_exact(WindowAttention, 6, bookkeeping)
    assert set(cov["covered"]) == {f"{n}.{p}" for n in ("q", "k", "v", "proj") for p in ("weight", "bias")}


class GlobalQueryWindowAttention(nn.Module):
    """GC ViT's and DaViT's layout: keys and values of every window from one projection, unbound from a dim before the
    merged batch (`kv.permute(2, 0, 3, 1, 4).unbind(0)`), and each image's global query repeated over its own windows
    (`q.repeat_interleave(windows, dim=0)`: the batch merged with its windows, sample-major)."""

    def __init__(self):
        super().__init__()
        self.kv, self.q, self.proj = nn.Linear(4, 8), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):  # x [B, 2 windows · 3 tokens, 4]
        b = x.shape[0]
        windows = x.view(b, 2, 3, 4).reshape(b * 2, 3, 4)
        k, v = self.kv(windows).reshape(b * 2, 3, 2, 2, 2).permute(2, 0, 3, 1, 4).unbind(0)
        q = self.q(x[:, :3]).repeat_interleave(2, dim=0).reshape(b * 2, 3, 2, 2).transpose(1, 2)
        a, c = torch.nn.functional.scaled_dot_product_attention(q, k, v).chunk(2, dim=-1)  # a split of another dim
        out = torch.cat([a, c * 2], -1)
        return self.proj(out.transpose(1, 2).reshape(b, 2, 3, 4).reshape(b, 6, 4))


@BOOKKEEPING
def test_keys_unbound_and_a_query_repeated_over_windows_merged_with_the_batch_are_exact(bookkeeping):
    cov = _strictly_exact(GlobalQueryWindowAttention, 6, bookkeeping)
    assert set(cov["covered"]) == {f"{n}.{p}" for n in ("kv", "q", "proj") for p in ("weight", "bias")}


def test_repeats_along_the_batch_merge_it_and_cuts_or_joins_along_it_lose_it():
    from gapmon.per_sample.batch_provenance import Merged

    tracker = BatchTracker(B)
    x = torch.randn(B, 3, 4)
    tracker.mark(x, 0)
    with tracker:
        repeated = x.repeat_interleave(2, dim=0)  # [B·2, 3, 4], each sample's rows together
        twice = repeated.repeat_interleave(3, dim=0)
        within = x.repeat_interleave(2, dim=1)
        by_tensor = x.repeat_interleave(torch.tensor([1] * (B - 1) + [2]), dim=0)
        parts = repeated.unbind(1)
        across = repeated.unbind(0)
        halves = repeated.split(2, dim=-1)
        joined, stacked = torch.cat(halves, -1), torch.stack(parts, 0)
        along = torch.cat([repeated, repeated], 0)
    assert tracker.status(joined) == Merged(0, 2) and tracker.status(stacked) == Merged(1, 2)
    assert isinstance(tracker.status(along), str)
    assert tracker.status(repeated) == Merged(0, 2) and tracker.status(twice) == Merged(0, 6)
    assert tracker.status(within) == 0 and isinstance(tracker.status(by_tensor), str)
    assert all(tracker.status(p) == Merged(0, 2) for p in parts + halves)
    assert all(isinstance(tracker.status(p), str) for p in across)


def test_overlapping_chunks_of_each_samples_rows_keep_the_batch():
    """Longformer's chunks: `as_strided` over [B·heads, T, d] (transposed, so not contiguous), each row's chunks
    overlapping within the row, then an einsum over the chunks of rows merged with the batch, and rows written into a
    new tensor. A view that reads across the rows (fewer of them, or a stride that reaches into the next row), or a
    write of some of the rows, loses it."""
    from gapmon.per_sample.batch_provenance import Merged

    tracker = BatchTracker(B)
    x = torch.randn(B, 6, 2, 4)
    tracker.mark(x, 0)
    with tracker:
        rows = x.transpose(1, 2).reshape(B * 2, 6, 4)  # [B·heads, T, d]: the batch merged with the heads
        seq = rows.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, T outermost in memory
        chunks = seq.view(B * 2, 3, 2, 4)
        size, stride = list(chunks.size()), list(chunks.stride())
        size[1], stride[1] = 5, stride[1] // 2  # chunks of 2 rows overlapping by 1
        overlapping = chunks.as_strided(size=size, stride=stride)
        scores = torch.einsum("bcxd,bcyd->bcxy", (overlapping, overlapping))
        across = chunks.as_strided(size=[B * 2 - 1, 3, 2, 4], stride=chunks.stride())
        skipping = chunks.as_strided(size=[B * 2, 4, 2, 4], stride=stride[:3] + [2])  # d's last 2 in the next row
        shifted = rows.new_zeros(B * 2, 6, 4)
        shifted[:, 1:] = rows[:, :-1]  # Longformer's diagonals written into a new tensor, every row of the batch's dim
        some = rows.new_zeros(B * 2, 6, 4)
        some[1:] = rows[1:]  # not every row: the first keeps zeros that are no sample's
    assert tracker.status(rows) == Merged(0, 2)
    assert tracker.status(overlapping) == Merged(0, 2) and tracker.status(scores) == Merged(0, 2)
    assert isinstance(tracker.status(across), str) and isinstance(tracker.status(skipping), str)
    assert tracker.status(shifted) == Merged(0, 2) and isinstance(tracker.status(some), str)


def test_attention_over_a_merged_batch_loses_it():
    """The batch merged into the positions attention runs over mixes the samples."""
    from gapmon.per_sample.batch_provenance import Merged

    tracker = BatchTracker(B)
    x = torch.randn(B, 3, 4)
    tracker.mark(x, 0)
    with tracker:
        rows = x.reshape(1, B * 3, 4)
        over_rows = torch.nn.functional.scaled_dot_product_attention(rows, rows, rows)
        windows = x.reshape(B * 3, 1, 4)
        per_window = torch.nn.functional.scaled_dot_product_attention(windows, windows, windows)
    assert tracker.status(rows) == Merged(1, 3) and isinstance(tracker.status(over_rows), str)
    assert tracker.status(per_window) == Merged(0, 3)


class RelativeAttentionBias(nn.Module):
    """T5's relative attention bias: an embedding of the [T, T] buckets every sample shares, permuted to
    [1, heads, T, T] and added to each sample's attention scores (eager attention)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(4, 4) for _ in range(4))
        self.rel = nn.Embedding(5, 2)

    def forward(self, x):  # x [B, T, 4]
        b, t, _ = x.shape
        q, k, v = (layer(x).view(b, t, 2, 2).transpose(1, 2) for layer in (self.q, self.k, self.v))
        buckets = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).clamp(-2, 2) + 2
        bias = self.rel(buckets).permute(2, 0, 1).unsqueeze(0)
        scores = q @ k.transpose(-1, -2) + bias
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, 4))


@BOOKKEEPING
def test_a_relative_attention_bias_permuted_before_its_add_is_exact(bookkeeping):
    assert "rel.weight" in _strictly_exact(RelativeAttentionBias, 5, bookkeeping)["covered"]


class ConstantQueries(nn.Module):
    """A layer run on the batch and on a table every sample shares (fixed queries, as Perceiver's latents): when the
    table's call gets a gradient, the sum of every sample's part, the layer is not per-sample; when its output is
    detached (`graded=False`: DoRA's weight norm), that call adds nothing and the layer is measured as usual."""

    def __init__(self, d=6, graded=True):
        super().__init__()
        self.proj, self.head, self.graded = nn.Linear(d, d), nn.Linear(d, 3), graded
        self.register_buffer("table", torch.randn(4, d, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):  # [B, T, d]
        keys = self.proj(self.table)  # [4, d]: no batch
        keys = keys if self.graded else keys.detach()
        h = self.proj(x)
        return self.head((h @ keys.T).softmax(-1) @ keys + h).mean(1)


def _proj_left_out_and_the_head_exact(psn, model, x, y, used_by: str) -> None:
    """After backward: the layer `proj`, whose output every sample shares, left out for its use by `used_by` (named
    when the norms are read); the head exact against a float64 loop."""
    with pytest.warns(RuntimeWarning, match=rf"layer 'proj' is not per-sample \(its output, shared by every sample, is "
                                            rf"used by {used_by}"):
        got = psn.local_norms()
    cov = psn.coverage()
    psn.close()
    assert set(cov["covered"]) == {"head.weight", "head.bias"}
    _exact(got, loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"])))


@BOOKKEEPING
def test_a_layer_call_on_a_shared_table_is_refused_when_its_output_gets_a_gradient(bookkeeping):
    x, y = torch.randn(3, 5, 6, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    model = ConstantQueries().double()
    psn = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing said at the call: its output may yet get no gradient
        loss = _loss(model(x), y)
    loss.backward()
    # (its call on the table is followed as one every sample shares, up to the matmul: no rule reads it there)
    _proj_left_out_and_the_head_exact(psn, model, x, y, "matmul")
    strict = gapmon.PerSampleGradNorms(model, strict=True)
    _loss(model(x), y).backward()  # not refused inside the forward or backward pass: when the norms are read
    with pytest.raises(RuntimeError, match="layer 'proj' is not per-sample"):
        strict.local_norms()
    strict.close()


@BOOKKEEPING
def test_a_layer_call_on_a_shared_table_whose_output_is_detached_is_passed_over(bookkeeping):
    x, y = torch.randn(3, 5, 6, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    model = ConstantQueries(graded=False).double()
    psn = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping, strict=True)
    _loss(model(x), y).backward()
    got, cov = psn.local_norms(), psn.coverage()
    psn.close()
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}
    want = loop_per_sample_norms(model, _loss, x, y)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class _Centred(torch.autograd.Function):
    """The batch centred on its mean inside a custom Function (its forward runs with grad off; its backward, its own,
    carries every sample's gradient into each row)."""

    @staticmethod
    def forward(ctx, x):
        return x - x.mean(0, keepdim=True)

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0, keepdim=True)


class _Swish(torch.autograd.Function):
    """A per-sample op with a backward of its own (a fused kernel's shape)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s + x * s * (1 - s))


class _OverCount(torch.autograd.Function):
    """A per-sample op scaled by a count of the whole batch that carries no gradient (a token count)."""

    @staticmethod
    def forward(ctx, x):
        ctx.count = (x.abs() > 0).sum()
        return x / ctx.count

    @staticmethod
    def backward(ctx, g):
        return g / ctx.count


class InsideFunctions(nn.Module):
    """A layer, then `how`: a custom Function that mixes the samples, one that does not, or a statistic of the batch
    taken under torch.no_grad and used as a constant; then a head."""

    def __init__(self, how):
        super().__init__()
        self.inp, self.head, self.how = nn.Linear(5, 6), nn.Linear(6, 3), how

    def forward(self, x):
        h = self.inp(x)
        if self.how == "centring Function":
            h = _Centred.apply(h)
        elif self.how == "per-sample Function":
            h = _Swish.apply(h)
        elif self.how == "Function over a count":
            h = _OverCount.apply(h)
        else:
            with torch.no_grad():
                scale = h.abs().amax(0) + 1.0
            h = h / scale
        return self.head(h)


@pytest.mark.parametrize("how", ["centring Function", "per-sample Function", "Function over a count",
                                 "statistic without gradient"])
def test_custom_functions_that_mix_the_samples_are_refused_and_others_exact(how):
    """A custom autograd Function's forward runs with grad off, so its ops that mix the samples carry no gradient
    there; its output does. Where such an op ran over inputs with a graph, the output is watched as the op's would
    be: a gradient through it refuses the norms (the layer before it got every sample's gradient: its norms had no
    meaning). A Function that keeps the samples apart, and a statistic under torch.no_grad used as a constant, stay
    exact (a count of the batch without a gradient is a constant there too)."""
    torch.manual_seed(0)
    model = InsideFunctions(how).double()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    ((model(x) - y) ** 2).sum().backward()
    if how == "centring Function":
        with pytest.raises(RuntimeError, match=r"forms a statistic of the whole batch.*sub of a sum over the batch"):
            psn.local_norms()
        psn.close()
        return
    got, cov = psn.local_norms(), psn.coverage()
    psn.close()
    if how == "per-sample Function":
        assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}
        _exact(got, loop_per_sample_norms(model, lambda o, t: ((o - t) ** 2).sum(), x, y))
    else:  # the scale is the batch's, a constant of the step: each sample's term of this batch's loss. Inside a
        # Function the batch is lost at the division (the head after it left out); a statistic taken under no_grad is
        # a constant the division keeps the rows with (the head covered too)
        inside = how == "Function over a count"
        params = list(model.inp.parameters()) + ([] if inside else list(model.head.parameters()))
        assert set(cov["covered"]) == {n for n, p in model.named_parameters() if any(p is q for q in params)}
        with torch.no_grad():
            h = model.inp(x)
            scale = (h.abs() > 0).sum() if inside else h.abs().amax(0) + 1.0
        want = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            (model.head(model.inp(x[i:i + 1]) / scale) - y[i:i + 1]).square().sum(), params)]).norm()
            for i in range(4)])
        _exact(got, want)


class RelativeTable(nn.Module):
    """DeBERTa's disentangled attention in small: the projection `proj` runs on the batch and on a table of positions
    every sample shares, whose result is split into heads, repeated over the batch (merged with the heads) and
    contracted with each sample's queries; with `extra`, the projected table is also summed and added to the output."""

    def __init__(self, extra=False, heads=2, d=8, span=5):
        super().__init__()
        self.proj, self.head, self.heads, self.extra = nn.Linear(d, d), nn.Linear(span, 3), heads, extra
        self.register_buffer("table", torch.randn(1, span, d, generator=torch.Generator().manual_seed(1)))

    def split(self, x):  # [n, L, d] -> [n·heads, L, d / heads]
        n, length, d = x.shape
        return x.view(n, length, self.heads, d // self.heads).permute(0, 2, 1, 3).reshape(-1, length, d // self.heads)

    def forward(self, x):  # [B, T, d]
        q = self.split(self.proj(x))  # [B·H, T, dh]
        projected = self.split(self.proj(self.table))  # [H, span, dh]
        pos = projected.repeat(x.shape[0], 1, 1)  # [B·H, span, dh]
        scores = torch.bmm(q, pos.transpose(-1, -2))  # [B·H, T, span]
        out = scores.view(x.shape[0], self.heads, *scores.shape[1:]).mean((1, 2))
        if self.extra:
            out = out + projected.sum()
        return self.head(out)


@BOOKKEEPING
def test_a_layer_run_on_a_shared_table_repeated_over_the_batch_is_exact(bookkeeping):
    torch.manual_seed(0)
    model = RelativeTable().double()
    x, y = torch.randn(3, 4, 8, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping, strict=True)
    _loss(model(x), y).backward()
    got, cov = psn.local_norms(), psn.coverage()
    psn.close()
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}
    _exact(got, loop_per_sample_norms(model, _loss, x, y))


def test_a_shared_tables_projection_also_summed_into_the_output_is_exact():
    """`out + projected.sum()`: the sum, of unbatched tensors only, is followed through its own vector-Jacobian product
    (followed_through) to where it is added to the batch; each sample's gradient reaches the projection's call on the
    table as its repeat's does."""
    torch.manual_seed(0)
    model = RelativeTable(extra=True).double()
    x, y = torch.randn(3, 4, 8, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, strict=True)
    _loss(model(x), y).backward()
    got, cov = psn.local_norms(), psn.coverage()
    psn.close()
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}
    _exact(got, loop_per_sample_norms(model, _loss, x, y))
