"""Computations every sample shares, between a model's own parameters (or a layer's call on a shared input) and where
they meet the batch (gapmon.per_sample.followed_through): each op of unbatched tensors only is followed through its
own vector-Jacobian product, a Linear or a norm run on such a tensor through its functional form's, and a pointwise op
where such a tensor meets the batch through the op's. Exact against a float64 loop, with and without book-keeping:
Swin V2's continuous position bias (an MLP over a table of coordinates, gathered per pair of positions, 16·sigmoid,
added to the scores of windows merged with the batch), BEiT's interpolated relative position table, a parameter
normalised, multiplied by itself or summed before its use, GeM pooling's learned exponent; a use that changes such a
tensor in place is left out by name, and one formed again differently (a random op) is refused by the checks."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_kept_under_bf16_autocast, loop_per_sample_norms, micro_batch_norms, norms_and_coverage

import gapmon
from gapmon.apps.examples import WindowAttentionV2

BOOKKEEPING = pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])


def _loss(out, t):
    return ((out - t) ** 2).flatten(1).sum(1).sum()


def _exact_and_whole(model, x, y, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got, cov = norms_and_coverage(model, _loss, x, y, strict=True, **kwargs)
    assert not cov["uncovered"] and not cov["skipped_layers"], cov["uncovered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)
    return cov


@BOOKKEEPING
@pytest.mark.parametrize("batch", [3, 2])
def test_swin_v2s_continuous_position_bias_is_exact(batch, bookkeeping):
    """Every parameter covered: the bias MLP's two Linear layers (the first on the table, the second on its ReLU, a
    followed tensor) and the temperature, exact; in a batch of 2 too, the size of the coordinate table's last dim (a
    buffer of the model: no sample's data)."""
    torch.manual_seed(0)
    model = WindowAttentionV2().double()
    x, y = torch.randn(batch, 18, 8, dtype=torch.float64), torch.randn(batch, 8, dtype=torch.float64)
    cov = _exact_and_whole(model, x, y, bookkeeping=bookkeeping)
    assert {"cpb_mlp.0.weight", "cpb_mlp.0.bias", "cpb_mlp.2.weight"} <= set(cov["covered"])


@pytest.mark.parametrize("model, shape", [(lambda: WindowAttentionV2(), (3, 18, 8)), (lambda: SharedMath("gram"), (4, 3, 5)),
                                          (lambda: SharedMath("matrix_exp"), (4, 3, 5))],
                         ids=["position bias MLP", "p @ p.T", "matrix_exp"])
def test_under_bf16_autocast_within_its_rounding(model, shape):
    """The ops formed again under the forward's autocast (a 16-bit product stays one): no layer left out, the norms
    within bf16's rounding of a float64 loop."""
    torch.manual_seed(0)
    model = model()
    out = model(torch.randn(*shape))
    assert_kept_under_bf16_autocast(model, _loss, torch.randn(*shape), torch.randn(shape[0], out.shape[-1]))


class InterpolatedTable(nn.Module):
    """BEiT's relative position table for another input size: a learned table [heads, 3, 3] interpolated (bilinear) to
    [heads, 5, 5], flattened and added to every sample's scores."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, 2, 3, 3) * 0.5)
        self.qk, self.head = nn.Linear(4, 8), nn.Linear(25, 3)

    def forward(self, x):  # x [B, 5, 4]
        q, k = self.qk(x).view(x.shape[0], 5, 2, 4).permute(0, 2, 1, 3).chunk(2, dim=-1)
        bias = F.interpolate(self.table, size=(5, 5), mode="bilinear", align_corners=False)  # [1, heads, 5, 5]
        scores = q @ k.transpose(-1, -2) + bias
        return self.head(scores.softmax(-1).flatten(2).mean(1))


@BOOKKEEPING
def test_an_interpolated_relative_position_table_is_exact(bookkeeping):
    torch.manual_seed(1)
    model = InterpolatedTable().double()
    _exact_and_whole(model, torch.randn(4, 5, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64),
                     bookkeeping=bookkeeping)


class SharedMath(nn.Module):
    """A parameter through ops of unbatched tensors only before it meets the batch (`use`)."""

    def __init__(self, use):
        super().__init__()
        self.use = use
        self.p = nn.Parameter(torch.randn(6, 6) * 0.4)
        self.lin, self.head = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x):  # x [B, T, 5]
        h = self.lin(x)
        if self.use == "gram":  # the parameter times itself: both inputs followed, their gradients added
            h = h @ (self.p @ self.p.T)
        elif self.use == "normalised":
            h = h * F.layer_norm(self.p.sum(0), (6,))
        elif self.use == "softmax":
            h = h + self.p.softmax(-1).mean(0)
        elif self.use == "matrix_exp":
            h = h @ torch.linalg.matrix_exp(self.p - self.p.T)
        return self.head(torch.tanh(h)).mean(1)


@BOOKKEEPING
@pytest.mark.parametrize("use", ["gram", "normalised", "softmax", "matrix_exp"])
def test_a_parameter_through_unbatched_ops_is_exact(use, bookkeeping):
    torch.manual_seed(2)
    model = SharedMath(use).double()
    _exact_and_whole(model, torch.randn(4, 3, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64),
                     bookkeeping=bookkeeping)


def test_micro_batches_give_each_samples_own_norm():
    """Two micro-batches (of 3 samples and of 1) accumulated in one step: each sample's own loss's norm."""
    torch.manual_seed(3)
    model = WindowAttentionV2().double()
    x, y = torch.randn(4, 18, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    got = micro_batch_norms(model, _loss, x, y, (slice(0, 3), slice(3, 4)))
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


class PointwiseMeeting(nn.Module):
    """A parameter that meets the batch in a pointwise op with no rule of its own: timm's GeM pooling with a learned
    exponent (`x.clamp(min=eps).pow(p)`, averaged, `.pow(1 / p)`), `torch.atan2(x, p)`, `torch.hypot`, and a
    parameter expanded to the batch's shape first (`p.expand_as(x)`, which reads only x's shape)."""

    def __init__(self, use):
        super().__init__()
        self.use = use
        self.conv, self.head = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)
        self.p = nn.Parameter(torch.full((1, 4, 1, 1), 3.0) + 0.2 * torch.randn(1, 4, 1, 1))

    def forward(self, x):  # x [B, 3, 6, 6]
        h = self.conv(x)
        if self.use == "gem":
            h = F.avg_pool2d(h.clamp(min=1e-6).pow(self.p), h.shape[-2:]).pow(1.0 / self.p)
        elif self.use == "atan2":
            h = torch.atan2(h, self.p).mean((2, 3), keepdim=True)
        elif self.use == "hypot, expanded":
            h = torch.hypot(h, self.p.expand_as(h)).mean((2, 3), keepdim=True)
        return self.head(h.flatten(1))


@BOOKKEEPING
@pytest.mark.parametrize("use", ["gem", "atan2", "hypot, expanded"])
def test_a_parameter_meeting_the_batch_in_a_pointwise_op_is_exact(use, bookkeeping):
    torch.manual_seed(6)
    model = PointwiseMeeting(use).double()
    cov = _exact_and_whole(model, torch.randn(3, 3, 6, 6, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64),
                           bookkeeping=bookkeeping)
    assert "p" in cov["covered"]


class InPlaceMLP(nn.Module):
    """A position MLP over a table every sample shares whose hidden activation is computed in place (`how`): its
    first layer's output overwritten (a view of its product: autograd rebases it, and a hook on it from before may not
    fire). relu and sigmoid give their slope from their output; log needs its input, which is gone."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.inp, self.out, self.lin = nn.Linear(2, 16), nn.Linear(16, 4, bias=False), nn.Linear(4, 4)
        self.register_buffer("table", torch.randn(1, 5, 2, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):  # x [B, 5, 4]
        h = self.inp(self.table)
        if self.how == "relu":
            F.relu(h, inplace=True)
        elif self.how == "sigmoid_":
            h.sigmoid_()
        else:
            h = h.abs() + 1
            h.log_()
        return self.lin(x) + torch.sigmoid(self.out(h))


@BOOKKEEPING
@pytest.mark.parametrize("how", ["relu", "sigmoid_"])
def test_an_activation_in_place_on_a_shared_output_is_exact(how, bookkeeping):
    torch.manual_seed(8)
    model = InPlaceMLP(how).double()
    _exact_and_whole(model, torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64),
                     bookkeeping=bookkeeping)


def test_an_in_place_function_whose_slope_needs_its_input_is_left_out_by_name():
    torch.manual_seed(8)
    model = InPlaceMLP("log_").double()
    x, y = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match=r"layer 'inp' is not per-sample .*used by log_"):
        got, cov = norms_and_coverage(model, _loss, x, y)
    assert {"inp.weight", "inp.bias"} <= set(cov["uncovered"]) and "out.weight" in cov["covered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"])),
                               rtol=1e-10, atol=1e-12)


class ChangedInPlace(nn.Module):
    """A tensor made from the parameter alone, changed in place before its use (or the parameter itself changed in
    place after the op that read it): no longer what the op made."""

    def __init__(self, where):
        super().__init__()
        self.where = where
        self.p = nn.Parameter(torch.randn(6) * 0.4 + 1)
        self.lin = nn.Linear(6, 3)
        self.register_buffer("scale", torch.ones(6))

    def forward(self, x):
        s = torch.lerp(self.p, self.scale, 0.25) if self.where == "buffer" else self.p.cumsum(0)
        if self.where == "output":
            s.mul_(2)
        out = self.lin(x * s)
        if self.where == "buffer":
            with torch.no_grad():  # an input of the op that made s, written afterwards (autograd saved none): its
                self.scale.mul_(2).div_(2)  # values are back, but only its version counter is seen
        return out


@pytest.mark.parametrize("where", ["output", "buffer"])
def test_a_shared_tensor_changed_in_place_is_left_out_by_name(where):
    torch.manual_seed(4)
    model = ChangedInPlace(where).double()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match=r"'p' is not per-sample"):
        got, cov = norms_and_coverage(model, _loss, x, y)
    assert "p" in cov["uncovered"] and {"lin.weight", "lin.bias"} <= set(cov["covered"])
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"])),
                               rtol=1e-10, atol=1e-12)


class RandomShared(nn.Module):
    """Dropout on a tensor every sample shares (one mask for every sample): formed again for the vector-Jacobian
    product, it draws another mask."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(6) * 0.4 + 1)
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x * torch.tanh(F.dropout(self.p, 0.5, training=True)))


def test_a_shared_tensor_formed_again_differently_is_refused_not_wrong():
    torch.manual_seed(5)
    model = RandomShared().double()
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    _loss(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match=r"'p' is not per-sample"):
        psn.local_norms()
    assert "p" in psn.coverage()["uncovered"]
    psn.close()


def test_a_product_that_cannot_be_formed_leaves_the_parameter_out_and_the_backward_alone(monkeypatch):
    """Forming a product again fails (here: torch.func.vjp raising, as an op without a functional form would): the
    tensors it would have reached are left out, named, and the user's backward and gradients are as without gapmon."""
    torch.manual_seed(7)
    model = SharedMath("gram").double()
    x, y = torch.randn(4, 3, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    _loss(model(x), y).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    def broken(*args, **kwargs):
        raise RuntimeError("no functional form")

    monkeypatch.setattr(torch.func, "vjp", broken)
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    _loss(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match=r"'p' is not per-sample .*could not be formed: RuntimeError"):
        psn.local_norms()
    assert "p" in psn.coverage()["uncovered"] and {"lin.weight", "head.weight"} <= set(psn.coverage()["covered"])
    psn.close()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=0)
