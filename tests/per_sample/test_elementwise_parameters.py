"""A model's own parameter passed through an elementwise function before its use (gapmon.per_sample.elementwise):
Swin V2's learned attention temperature `clamp(logit_scale, max=log 100).exp()`, a gate's `sigmoid()`, a softplus'd
scale, a power. Each sample's gradient of the parameter is its gradient of the function's output times the slope:
exact against a float64 loop, with and without book-keeping; a function without a slope here is taken back through
its own vector-Jacobian product (followed_through)."""
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import loop_per_sample_norms, norms_and_coverage

from gapmon.per_sample import elementwise

BOOKKEEPING = pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])


def _loss(out, t):
    return ((out - t) ** 2).flatten(1).sum(1).sum()


class CosineAttention(nn.Module):
    """Swin V2's scaled cosine attention over each sample's tokens: its temperature a parameter per head, clamped and
    exponentiated before it scales the cosine similarities; `gate`: how a second parameter scales the output."""

    def __init__(self, d=8, heads=2, gate="sigmoid"):
        super().__init__()
        self.heads, self.gate = heads, gate
        self.qkv = nn.Linear(d, 3 * d)
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(heads, 1, 1)) + 0.3 * torch.randn(heads, 1, 1))
        self.gamma = nn.Parameter(torch.randn(d) * 0.5)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        y = self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))
        scale = {"sigmoid": lambda g: g.sigmoid(), "softplus": F.softplus, "tanh": torch.tanh,
                 "square": lambda g: g ** 2, "abs": torch.abs, "clamp_min": lambda g: g.clamp_min(-0.2),
                 "expm1": torch.expm1, "cumsum": lambda g: g.cumsum(0),
                 "sigmoid, cumsum detached": lambda g: g.sigmoid() * (1 + g.cumsum(0).detach().abs() / 8)}[self.gate](self.gamma)
        return self.head((x + y * scale).mean(1))


def _data(seed):
    torch.manual_seed(seed)
    return torch.randn(4, 5, 8, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)


@BOOKKEEPING
@pytest.mark.parametrize("gate", ["sigmoid", "softplus", "tanh", "square", "abs", "clamp_min", "expm1",
                                  "sigmoid, cumsum detached"])
def test_parameters_through_elementwise_functions_are_exact(gate, bookkeeping):
    x, y = _data(0)
    model = CosineAttention(gate=gate).double()
    got, cov = norms_and_coverage(model, _loss, x, y, strict=True, bookkeeping=bookkeeping)
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


def test_a_clamp_that_cuts_keeps_no_gradient_where_it_cuts():
    """Heads whose temperature the clamp cuts get no gradient through it (the loop's reference says the same)."""
    x, y = _data(1)
    model = CosineAttention().double()
    with torch.no_grad():
        model.logit_scale[0] = math.log(100.0) + 1.0  # clamped: no gradient for this head
    got, cov = norms_and_coverage(model, _loss, x, y, strict=True)
    assert "logit_scale" in cov["covered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


def test_a_function_without_a_slope_is_taken_back_through_its_own_product():
    """gamma.cumsum(...): no slope (not elementwise), but every input unbatched: followed through the op's
    vector-Jacobian product (followed_through), exact."""
    x, y = _data(2)
    model = CosineAttention(gate="cumsum").double()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got, cov = norms_and_coverage(model, _loss, x, y)
    assert {"gamma", "logit_scale"} <= set(cov["covered"]) and not cov["uncovered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name, args, kwargs", [
    ("exp", (), {}), ("expm1", (), {}), ("log", (), {}), ("log1p", (), {}), ("sigmoid", (), {}), ("tanh", (), {}),
    ("sqrt", (), {}), ("rsqrt", (), {}), ("square", (), {}), ("reciprocal", (), {}), ("relu", (), {}),
    ("abs", (), {}), ("clamp", (0.2, 1.1), {}), ("clamp", (), {"max": 0.9}), ("clip", (None, 0.7), {}),
    ("clamp_min", (0.5,), {}), ("clamp_max", (0.5,), {}), ("pow", (3,), {}), ("pow", (0,), {}),
    ("__pow__", (-0.5,), {}), ("softplus", (), {"beta": 2.0}), ("softplus", (0.5, 0.3), {}), ("__rdiv__", (2.0,), {}),
    ("__rtruediv__", (-3,), {})])
def test_slopes_equal_autograds(name, args, kwargs):
    """Each slope against autograd's own derivative, on values that cross every bound and threshold (float64)."""
    torch.manual_seed(3)
    x = torch.cat([torch.rand(40, dtype=torch.float64) * 2 + 0.05, torch.tensor([0.2, 0.5, 0.7, 0.9, 1.1],
                                                                                dtype=torch.float64)])
    fn = getattr(F, name) if name == "softplus" else getattr(torch.Tensor, name)
    leaf = x.clone().requires_grad_()
    out = fn(leaf, *args, **kwargs)
    (want,) = torch.autograd.grad(out.sum(), leaf)
    torch.testing.assert_close(elementwise.slope(name, (x, *args), kwargs, x, fn(x, *args, **kwargs)), want,
                               rtol=1e-12, atol=1e-12)


def test_functions_with_a_tensor_argument_have_no_slope():
    x = torch.rand(5, dtype=torch.float64)
    assert elementwise.slope("clamp", (x, x * 0.5), {}, x, x.clamp(x * 0.5)) is None
    assert elementwise.slope("pow", (x, x), {}, x, x.pow(x)) is None
    assert elementwise.slope("cumsum", (x, 0), {}, x, x.cumsum(0)) is None
    assert elementwise.slope("exp", (x,), {}, x, x.exp().sum()) is None  # not of x's shape


class DecayScan(nn.Module):
    """RWKV's state update: a running maximum of each sample's keys and a learned (exponentiated) decay, the first step's
    state a constant: `torch.maximum(state + decay, key)` with `state` = zeros_like(key) - 1e38, then batched."""

    def __init__(self, d=6, which="maximum"):
        super().__init__()
        self.key, self.head = nn.Linear(d, d), nn.Linear(d, 3)
        self.time_decay = nn.Parameter(torch.randn(d) * 0.5)
        self.which = which

    def forward(self, x):  # [B, T, d]
        keys = self.key(x)
        decay = -torch.exp(self.time_decay)
        big = 1e38 if self.which == "maximum" else -1e38
        state = torch.zeros_like(keys[:, 0]) - big
        for t in range(keys.shape[1]):
            state = getattr(torch, self.which)(state + decay, keys[:, t])
        return self.head(state)


@BOOKKEEPING
@pytest.mark.parametrize("which", ["maximum", "minimum"])
def test_a_running_extremum_with_a_parameter_is_exact(which, bookkeeping):
    x, y = _data(4)
    model = DecayScan(which=which).double()
    got, cov = norms_and_coverage(model, _loss, x[:, :, :6], y, strict=True, bookkeeping=bookkeeping)
    assert "time_decay" in cov["covered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x[:, :, :6], y), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["maximum", "minimum"])
def test_extremum_slopes_equal_autograds(name):
    """Ties split the gradient in halves, a NaN on either side keeps it, as torch's backward does."""
    x = torch.tensor([1.0, 2.0, 3.0, float("nan"), 1.0, -1.0], dtype=torch.float64)
    other = torch.tensor([[2.0, 2.0, 1.0, 0.0, float("nan"), -1.0]] * 2, dtype=torch.float64)
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(getattr(torch, name)(leaf, other).sum(), leaf)
    torch.testing.assert_close(elementwise.extremum_slope(name, x, other).sum(0), want)


class WeightDecomposed(nn.Module):
    """DoRA's shape of computation in plain torch: an adapter's output scaled per output row by magnitude / ||W + BA||,
    the norm formed by running the adapter on an identity matrix and detached (a constant of the step); `how` picks
    the product or quotient that meets the batch."""

    def __init__(self, d=6, how="over"):
        super().__init__()
        self.base, self.a, self.b = nn.Linear(d, d), nn.Linear(d, 2, bias=False), nn.Linear(2, d, bias=False)
        self.base.requires_grad_(False)
        self.magnitude = nn.Parameter(torch.rand(d) + 0.5)
        self.head, self.how = nn.Linear(d, 3), how

    def forward(self, x):
        eye = torch.eye(self.a.in_features, dtype=x.dtype)
        norm = (self.base.weight + self.b(self.a(eye)).T).norm(dim=1).detach()
        scale = {"over": lambda: self.magnitude / norm, "times": lambda: self.magnitude * norm,
                 "times_left": lambda: norm * self.magnitude, "under": lambda: norm / self.magnitude,
                 "number_under": lambda: 2.0 / self.magnitude, "pow": lambda: self.magnitude ** norm}[self.how]()
        out = (scale.view(1, 1, -1) - 1) * self.base(x) + scale * self.b(self.a(x))
        return self.head(out.mean(1))


@BOOKKEEPING
@pytest.mark.parametrize("how", ["over", "times", "times_left", "under", "number_under"])
def test_a_parameter_times_or_over_a_constant_tensor_is_exact(how, bookkeeping):
    """The layers run on the identity matrix (their output detached) are measured over their batched calls alone."""
    x, y = _data(5)
    model = WeightDecomposed(how=how).double()
    got, cov = norms_and_coverage(model, _loss, x[:, :, :6], y, strict=True, bookkeeping=bookkeeping)
    assert set(cov["covered"]) == {n for n, p in model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x[:, :, :6], y), rtol=1e-10, atol=1e-12)


def test_a_constant_tensor_power_of_a_parameter_is_taken_back_through_its_own_product():
    """magnitude ** (a constant tensor): no slope of its own, followed through the op's vector-Jacobian product, exact."""
    x, y = _data(6)
    model = WeightDecomposed(how="pow").double()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got, cov = norms_and_coverage(model, _loss, x[:, :, :6], y)
    assert {"magnitude", "a.weight"} <= set(cov["covered"]) and not cov["uncovered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x[:, :, :6], y), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name, left", [("mul", False), ("mul", True), ("div", False), ("div", True)])
def test_factor_slopes_equal_autograds(name, left):
    torch.manual_seed(4)
    x, c = torch.rand(3, 4, dtype=torch.float64) + 0.1, torch.rand(4, dtype=torch.float64) + 0.1
    args = (c, x) if left else (x, c)
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(getattr(torch, name)(*((c, leaf) if left else (leaf, c))).sum(), leaf)
    torch.testing.assert_close(elementwise.slope(name, args, {}, x, getattr(torch, name)(*args)), want,
                               rtol=1e-12, atol=1e-12)
