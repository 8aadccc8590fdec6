"""Per-sample norms always have one entry per sample, ids travel exactly, and misuse is named where it
happens (#34 items 1-3)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import gapmon


class _PackedLSTMHead(nn.Module):
    """An LSTM over a packed sequence (its time steps interleave the samples) and a Linear head after it."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        packed = nn.utils.rnn.pack_padded_sequence(x, [7, 5, 5, 3, 1], batch_first=True)
        return self.head(nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)[0])


def _excluded_everywhere():
    """Models whose every covered layer is excluded at run time (the batch cannot be followed to them)."""
    torch.manual_seed(0)
    yield "packed LSTM + Linear head", _PackedLSTMHead(), torch.randn(5, 7, 4)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0)  # sequence-first, batch_dim left at 0
    yield "sequence-first TransformerEncoderLayer", layer, torch.randn(7, 5, 8)


@pytest.mark.parametrize("case", ["packed LSTM + Linear head", "sequence-first TransformerEncoderLayer"])
def test_norms_have_one_entry_per_sample_when_every_layer_is_excluded(case):
    name, model, x = next(c for c in _excluded_everywhere() if c[0] == case)
    batch = x.shape[0]  # batch_dim=0 as given: the first dim is what gapmon calls the batch
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        norms = gapmon.PerSampleGradNorms(model)
        model(x).square().mean().backward()
        got = norms.local_norms()
    assert got.shape == (batch,) and (got == 0).all()
    assert any("not per-sample" in str(w.message) or "excluded" in str(w.message) for w in seen)
    norms.close()
    model.zero_grad()
    with pytest.raises((RuntimeError, ValueError), match="not per-sample|excluded"):  # strict: refused, not zeros
        strict = gapmon.PerSampleGradNorms(model, strict=True)
        model(x).square().mean().backward()
        strict.local_norms()


def test_global_ids_travel_exactly_and_norms_keep_their_dtype():
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    norms = gapmon.PerSampleGradNorms(model)
    model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    big = [2**62 + 3, 2**62 + 1, 2**53 + 1, 2**53]  # hashed ids: not exact in float64
    ids, got = norms.global_norms(big)
    assert ids.dtype == torch.int64 and ids.tolist() == sorted(big)
    assert got.dtype == torch.float64
    order = sorted(range(4), key=lambda i: big[i])
    assert got.tolist() == norms.local_norms()[order].tolist()


@pytest.mark.parametrize("ids, error", [([0.2, 0.7, 1.0, 2.0], "must be integers"), ([1, 2, 2, 3], "repeat"),
                                        (torch.tensor([True, False, True, True]), "integers"),
                                        ([0.0, 1.0, 2.0, float(2**60)], "2\\^53")])
def test_bad_sample_ids_are_refused_naming_them(ids, error):
    model = nn.Linear(3, 2)
    norms = gapmon.PerSampleGradNorms(model)
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises((TypeError, ValueError), match=error):
        norms.global_norms(ids)


def test_local_norms_before_backward_says_so_and_leaves_backward_working():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    norms = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    x = torch.randn(3, 3, dtype=torch.float64)
    out = model(x)
    with pytest.raises(RuntimeError, match="after loss.backward"):
        norms.local_norms()
    out.square().sum().backward()  # the user's own backward still works
    got = norms.local_norms().tolist()
    norms.close()
    want = []
    for i in range(3):
        model.zero_grad()
        model(x[i:i + 1]).square().sum().backward()
        want.append(float(sum(p.grad.square().sum() for p in model.parameters())) ** 0.5)
    assert got == pytest.approx(want, rel=1e-12)


def test_an_empty_batch_gives_an_empty_result():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    norms = gapmon.PerSampleGradNorms(model)
    model(torch.randn(0, 3)).sum().backward()
    got = norms.local_norms()
    assert got.shape == (0,)
    ids, values = norms.global_norms(torch.empty(0, dtype=torch.int64))
    assert ids.shape == values.shape == (0,)
