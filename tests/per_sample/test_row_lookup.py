"""row_lookup.py: an Embedding subclass with a forward of its own (Hugging Face's learned position tables) looked up
by ids no sample's data flows into is followed by id, exact against a float64 loop of each sample's own loss; a use
that does not put each sample's rows on that sample's leaves the table out, named."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import loop_per_sample_norms, norms_and_coverage

from gapmon.per_sample import free_parameters

BOOKKEEPING = pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])
V, T, D = 13, 6, 8


class Positions(nn.Embedding):
    """A learned position table whose forward makes its own ids from the input's shape, as BART's, OPT's and
    Whisper's do."""

    def __init__(self, how: str):
        super().__init__(T + 2, D)
        self.how = how

    def forward(self, ids):
        b, t = ids.shape
        if self.how == "expanded":  # BART: arange(T).expand(B, -1), offset by 2
            return super().forward(torch.arange(t).expand(b, -1) + 2)
        if self.how == "one_row":  # BART given position ids [1, T]
            return super().forward(torch.arange(t).unsqueeze(0))
        if self.how == "one_dim":  # ids [T]: the output [T, D] broadcast over the batch
            return super().forward(torch.arange(t))
        if self.how == "ones_cumsum":  # OPT without a mask: the positions of an all-ones mask it makes
            mask = torch.ones(b, t, dtype=torch.long)
            return super().forward((torch.cumsum(mask, 1) * mask - 1) + 2)
        if self.how == "indexed":  # Whisper: self.weight[position_ids], the ids repeated over the batch
            return self.weight[torch.arange(t).unsqueeze(0).repeat(b, 1)]
        if self.how == "padded":  # a padding id in the rows: its row gets no gradient
            return F.embedding(torch.arange(t).expand(b, -1) % 4, self.weight, padding_idx=3)
        if self.how == "flipped":  # each sample's rows moved to another sample
            return super().forward(torch.ones(b, t, dtype=torch.long).cumsum(1)).flip(0)
        if self.how == "sliced":  # a slice of the table added to the batch: per-sample gradients formed whole
            return self.weight[:t]
        raise ValueError(self.how)


class Model(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(V, D), Positions(how), nn.Linear(D, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.tok(ids) + self.pos(ids)))


def _loss(out, y):
    return ((out - y) ** 2).sum()


def _run(how, bookkeeping, batch=4):
    torch.manual_seed(0)
    model = Model(how).double()
    ids, y = torch.randint(0, V, (batch, T)), torch.randn(batch, T, 3, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, cov = norms_and_coverage(model, _loss, ids, y, bookkeeping=bookkeeping)
    want = loop_per_sample_norms(model, _loss, ids, y, params=set(cov["covered"]))
    return got, want, cov, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@BOOKKEEPING
@pytest.mark.parametrize("how", ["expanded", "one_row", "one_dim", "ones_cumsum", "indexed", "padded", "sliced"])
@pytest.mark.parametrize("batch", [1, 4])
def test_a_position_subclass_is_followed_by_id_and_exact(how, batch, bookkeeping):
    got, want, cov, warned = _run(how, bookkeeping, batch)
    assert "pos.weight" in cov["covered"] and not cov["uncovered"], cov["uncovered_reasons"]
    assert not warned, warned
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("how", ["one_dim", "expanded"])
def test_positions_as_long_as_the_batch_are_read_by_their_use(how):
    """Positions [T] with T equal to the batch's size look like a row per sample: broadcast over the batch where they
    are added, they are every sample's (one_dim); a row per sample added row by row, each sample's (expanded)."""
    got, want, cov, warned = _run(how, False, batch=T)
    assert "pos.weight" in cov["covered"] and not warned, warned
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_padding_row_and_unused_rows_get_nothing():
    """The norms are of the rows the ids reach, but the padding id's: a loop over the samples agrees only so."""
    got, want, cov, _ = _run("padded", False)
    assert "pos.weight" in cov["covered"]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@BOOKKEEPING
def test_rows_moved_to_other_samples_leave_the_table_out_named(bookkeeping):
    got, want, cov, warned = _run("flipped", bookkeeping)
    assert "pos.weight" in cov["uncovered"] and {"tok.weight", "head.weight"} <= set(cov["covered"])
    assert any("pos.weight" in w and "in flip," in w for w in warned), warned
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_use_that_would_form_too_large_per_sample_gradients_is_left_out_named(monkeypatch):
    monkeypatch.setattr(free_parameters, "_MAX_FORMED", (T + 2) * D * 4 - 1)  # one element short of batch x table
    got, want, cov, warned = _run("sliced", False)
    assert "pos.weight" in cov["uncovered"] and "tok.weight" in cov["covered"]
    assert any("more than" in w for w in warned), warned
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
