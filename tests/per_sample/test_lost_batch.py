"""A gradient that comes back through an op where the batch tracking lost the batch (gapmon.per_sample.lost_batch):
the layers and free parameters it reaches are left out, named, since their per-sample gradients may hold other
samples' losses; the rest stays covered and exact against float64 loops. Constants of the step (a statistic of the
batch without a gradient) and lookups of a table by each sample's ids keep the batch."""
import warnings

import pytest
import torch
import torch.nn as nn
from helpers import loop_per_sample_norms, norms_and_coverage

import gapmon
from gapmon.per_sample.lost_batch import upstream_leaves


def _sq(out, y):
    return ((out - y) ** 2).sum()


def _exact(got, want):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class Mixed(nn.Module):
    """Two layers, between them `how` (an op that loses the batch); with `side`, a parallel layer the op never sees."""

    def __init__(self, how, side=False):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 4), nn.Linear(4, 2), how
        self.side = nn.Linear(4, 2) if side else None
        self.pos = nn.Parameter(torch.randn(4) * 0.1)  # a free parameter added before the op

    def mixed(self, x):
        """What b reads."""
        h = self.a(x) + self.pos
        if self.how == "roll":  # sample b's row gets sample b-1's too (an op whose rule says it moves the samples)
            return h + h.roll(1, 0)
        if self.how == "pinv":  # an op without a batch rule, which mixes the samples
            return h + torch.linalg.pinv(h).T
        if self.how == "detached":  # the mixed part carries no gradient back: a constant of the step
            return h + h.detach().roll(1, 0)
        h.roll(1, 0)  # "unused": the op's output never reaches the loss
        return h

    def forward(self, x):
        out = self.b(self.mixed(x))
        return out if self.side is None else (out, self.side(x))  # (the loss adds the two)


def _sq_sides(out, y):
    return _sq(out, y) if isinstance(out, torch.Tensor) else _sq(out[0], y) + _sq(out[1], y)


@pytest.mark.parametrize("how", ["roll", "pinv"])
@pytest.mark.parametrize("side", [False, True])
def test_what_lies_before_an_op_that_loses_the_batch_is_left_out_once_a_gradient_comes_back(how, side):
    """Before, the layer before the op kept norms of gradients that held several samples' losses (no loop of each
    sample's own loss gives them); now it and the free parameter are left out, named, and strict refuses. The layer
    after it is left out as before (its input's batch lost there); a parallel layer the op never reaches stays covered
    and exact."""
    torch.manual_seed(0)
    model = Mixed(how, side).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, cov = norms_and_coverage(model, _sq_sides, x, y)
    said = [str(w.message) for w in caught]
    name = {"roll": "roll along the batch dim", "pinv": "linalg_pinv (no batch rule for this op)"}[how]
    for left_out in ("a", "pos"):
        assert any(f"'{left_out}' is not per-sample (a gradient comes back to it through {name}" in m for m in said), said
    assert any("'b' is not per-sample (the batch dim of its input was lost" in m for m in said), said
    kept = {"side.weight", "side.bias"} if side else set()
    assert set(cov["covered"]) == kept
    if side:
        _exact(got, loop_per_sample_norms(model, _sq_sides, x, y, params=kept))
    else:
        assert got.shape == (5,) and not got.any()
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    with pytest.raises(RuntimeError, match=r"is not per-sample"):  # (b, in the forward pass)
        _sq_sides(model(x), y).backward()
        psn.local_norms()
    psn.close()


@pytest.mark.parametrize("how", ["detached", "unused"])
def test_an_op_that_loses_the_batch_without_a_gradient_back_leaves_every_layer_covered(how):
    torch.manual_seed(1)
    model = Mixed(how).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    got, cov = norms_and_coverage(model, _sq, x, y, strict=True)
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}
    if how == "unused":  # every layer per-sample: exact against a loop
        _exact(got, loop_per_sample_norms(model, _sq, x, y))
        return
    mixed = (model.a(x) + model.pos).detach().roll(1, 0)  # the batch's constant, as the step saw it
    want = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        _sq(model.b(model.a(x[i:i + 1]) + model.pos + mixed[i:i + 1]), y[i:i + 1]), list(model.parameters()))]).norm()
        for i in range(5)])
    _exact(got, want)


def test_one_sample_cannot_mix():
    """What lies before the op keeps its norms (b, after it, is left out as before: its input's batch is lost)."""
    torch.manual_seed(3)
    model = Mixed("roll").double()
    x, y = torch.randn(1, 4, dtype=torch.float64), torch.randn(1, 2, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, cov = norms_and_coverage(model, _sq, x, y)
    assert not any("gradient comes back" in str(w.message) for w in caught)
    assert set(cov["covered"]) == {"a.weight", "a.bias", "pos"}
    _exact(got, loop_per_sample_norms(model, _sq, x, y, params=set(cov["covered"])))


class ScaledByTheBatch(nn.Module):
    """A statistic of the batch taken without a gradient, used as a constant by a pointwise op (a scale, a mask)."""

    def __init__(self, how):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 6), nn.Linear(6, 2), how

    def forward(self, x):
        h = self.a(x)
        if self.how == "scale":
            h = h / (h.abs().amax(0).detach() + 1.0)
        else:
            h = torch.where(h > h.mean(0).detach(), h, 0.5 * h)
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("how", ["scale", "mask"])
def test_a_constant_of_the_step_keeps_the_batch(how):
    """Each sample's loss term with the batch's constant in it: every layer covered, exact against a loop that uses
    the same constant."""
    torch.manual_seed(4)
    model = ScaledByTheBatch(how).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    got, cov = norms_and_coverage(model, _sq, x, y, strict=True)
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}
    with torch.no_grad():
        h = model.a(x)
        const = h.abs().amax(0) + 1.0 if how == "scale" else h.mean(0)

    def one(i):
        h = model.a(x[i:i + 1])
        h = h / const if how == "scale" else torch.where(h > const, h, 0.5 * h)
        return _sq(model.b(torch.tanh(h)), y[i:i + 1])

    want = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(one(i), list(model.parameters()))]).norm()
                        for i in range(5)])
    _exact(got, want)


def test_the_walk_finds_the_parameters_a_node_reaches():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    x = torch.randn(2, 3)
    h = a(x)
    out = b(h) + h
    leaves = upstream_leaves(h.grad_fn)
    assert {id(a.weight), id(a.bias)} <= leaves and not ({id(b.weight), id(b.bias)} & leaves)
    assert {id(b.weight), id(a.weight)} <= upstream_leaves(out.grad_fn)
    assert upstream_leaves(None) is None


class ChangedInPlace(nn.Module):
    """The output of an op that lost the batch changed in place before its use (`y = h.roll(1, 0); y.mul_(2)`)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        y = h.roll(1, 0)
        y.mul_(2.0)
        return self.b(h + y)


def test_an_op_that_lost_the_batch_changed_in_place_still_leaves_out_what_it_reaches():
    torch.manual_seed(5)
    model = ChangedInPlace().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match=r"'a' is not per-sample \(a gradient comes back to it through roll"):
        got, cov = norms_and_coverage(model, _sq, x, y)
    assert not cov["covered"] and got.shape == (5,) and not got.any()
