"""An embedding's table used as the output head by the model's own forward (`F.linear(h, self.wte.weight)`: the original
OLMo's weight tying, hand-written GPTs' `h @ self.wte.weight.T`): exact against a float64 per-sample loop, or left
out by name where the table has another use the tracking cannot follow (functional_head)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_kept_under_bf16_autocast, loop_per_sample_norms

import gapmon

VOCAB, WIDTH = 13, 6

HEADS = {
    "F.linear": lambda h, w: F.linear(h, w),
    "F.linear-None-bias": lambda h, w: F.linear(h, w, None),
    "F.linear-by-name": lambda h, w: F.linear(h, weight=w),
    "matmul-T": lambda h, w: h @ w.T,
    "matmul-t()": lambda h, w: torch.matmul(h, w.t()),
    "matmul-transpose": lambda h, w: h @ w.transpose(0, 1),
    "einsum": lambda h, w: torch.einsum("btd,vd->btv", h, w),
    "einsum-transposed": lambda h, w: torch.einsum("btd,dv->btv", h, w.T),
    "cast": lambda h, w: F.linear(h, w.to(h.dtype)),
}


class FunctionalHeadLM(nn.Module):
    """A tiny language model whose logits are its embedding table times the last hidden states."""

    def __init__(self, head: str = "F.linear", positions: bool = True):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(8, WIDTH) if positions else None
        self.block = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.norm = nn.LayerNorm(WIDTH)
        self.head = HEADS[head]

    def forward(self, ids):
        h = self.wte(ids)
        if self.wpe is not None:
            h = h + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        h = self.norm(h + self.block(h))
        return self.head(h, self.wte.weight)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")


def _batch(batch=4, length=7):
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, length))
    ids[0, :3] = 5  # a repeated id
    ids[1, 2] = ids[1, 5]
    return ids, (ids * 3 + 1) % VOCAB


def _assert_whole_and_exact(model: nn.Module, bookkeeping: bool = False) -> gapmon.PerSampleGradNorms:
    """Strict norms of one summed-loss step of a float64 model: every parameter covered (the table too), none left
    out, equal to a float64 loop. Returns the (closed) norms object."""
    ids, targets = _batch()
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True, bookkeeping=bookkeeping)
    lm_loss(model(ids), targets).backward()
    got, cov = psn.local_norms(), psn.coverage()
    psn.close()
    assert "wte.weight" in cov["covered"] and cov["uncovered_numel"] == 0 and not cov["skipped_layers"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, lm_loss, ids, targets), rtol=1e-10, atol=1e-12)
    return psn


@pytest.mark.parametrize("bookkeeping", [False, True], ids=["norms", "bookkeeping"])
@pytest.mark.parametrize("head", sorted(HEADS))
def test_a_table_used_as_the_head_in_the_forward_is_exact(head, bookkeeping):
    torch.manual_seed(0)
    _assert_whole_and_exact(FunctionalHeadLM(head).double(), bookkeeping)


def test_micro_batches_mean_reduction_and_several_steps():
    """Two micro-batches per step (mean losses), three steps: every step's norms exact, the table's layer type the
    embedding's."""
    torch.manual_seed(0)
    model = FunctionalHeadLM("F.linear").double()
    ids, targets = _batch(batch=5)
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="mean", strict=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def mean_loss(logits, t):
        return lm_loss(logits, t) / t.shape[0]

    for _ in range(3):
        for part in (slice(0, 2), slice(2, 5)):
            mean_loss(model(ids[part]), targets[part]).backward()
        got = psn.local_norms()
        reference = FunctionalHeadLM("F.linear").double()  # (not the monitored model: its forwards would be collected)
        reference.load_state_dict(model.state_dict())
        want = torch.cat([loop_per_sample_norms(reference, lm_loss, ids[part], targets[part])
                          for part in (slice(0, 2), slice(2, 5))])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        types = psn.covered_layer_types()
        opt.step()
        opt.zero_grad()
    assert types["wte.weight"] == "Embedding"
    psn.close()


def test_autocast_bf16_is_not_refused():
    """Under bf16 autocast the head's product runs in bf16: the norms match a float64 loop within bf16's rounding,
    and the use check (bf16's tolerance) keeps the table."""
    torch.manual_seed(0)
    assert_kept_under_bf16_autocast(FunctionalHeadLM("F.linear"), lm_loss, *_batch())


def test_no_head_use_leaves_the_embedding_as_it_was():
    """A model that never uses its table as a head: the same norms as before (no tie made), exact."""
    class NoHead(FunctionalHeadLM):
        def __init__(self):
            super().__init__()
            self.out = nn.Linear(WIDTH, VOCAB)

        def forward(self, ids):
            h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
            return self.out(self.norm(h + self.block(h)))

    torch.manual_seed(0)
    psn = _assert_whole_and_exact(NoHead().double())
    assert not psn._layer_hooks.tied.members


def test_a_statistic_of_the_table_without_grad_is_not_a_use():
    """The forward reads the table under torch.no_grad (a constant of the step): not refused, exact against a loop that
    uses the same constant."""
    class Scaled(FunctionalHeadLM):
        def forward(self, ids):
            with torch.no_grad():
                scale = self.wte.weight.norm()
            return super().forward(ids) / scale

    torch.manual_seed(0)
    _assert_whole_and_exact(Scaled().double())


class _OtherUse(FunctionalHeadLM):
    """The table used as the head and also in an op no rule follows for it (the logits scaled by its mean size)."""

    def forward(self, ids):
        logits = super().forward(ids)
        return logits * self.wte.weight.abs().mean()


def test_another_use_of_the_table_leaves_it_out_by_name_and_the_rest_exact():
    torch.manual_seed(0)
    model = _OtherUse().double()
    ids, targets = _batch()
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    with pytest.warns(RuntimeWarning, match=r"layer 'wte' is not per-sample"):
        lm_loss(model(ids), targets).backward()
        got = psn.local_norms()
    cov = psn.coverage()
    psn.close()
    assert "wte.weight" in cov["uncovered"] and "wte" in cov["skipped_layers"]
    rest = {n for n, _ in model.named_parameters() if n != "wte.weight"}
    torch.testing.assert_close(got, loop_per_sample_norms(model, lm_loss, ids, targets, params=rest),
                               rtol=1e-10, atol=1e-12)


def test_another_use_of_the_table_is_refused_under_strict():
    model = _OtherUse().double()
    ids, targets = _batch()
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    with pytest.raises(RuntimeError, match="wte"):
        lm_loss(model(ids), targets).backward()
        psn.local_norms()
    psn.close()


def test_a_head_over_samples_mixed_is_refused():
    """The head's input mixes the samples (each row holds the previous sample's too): no per-sample gradient of the
    table, which is left out with the layers before it; the head's own layer type is never reported."""
    class Mixed(FunctionalHeadLM):
        def forward(self, ids):
            h = self.norm(self.wte(ids))
            return F.linear(h + h.roll(1, 0), self.wte.weight)

    model = Mixed().double()
    ids, targets = _batch()
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    with pytest.warns(RuntimeWarning, match="wte"):
        lm_loss(model(ids), targets).backward()
        psn.local_norms()
    cov = psn.coverage()
    assert "wte" in cov["skipped_layers"] and "wte.weight" in cov["uncovered"]
    psn.close()
